"""A local Google Cloud Storage for the tests of gs:// run directories: gcp-storage-emulator (from
the package index) in a thread, selected by STORAGE_EMULATOR_HOST as Google's clients select it.

The emulator's downloads lack the x-goog-generation header that Cloud Storage sends with every
object. TensorStore (Orbax's arrays) reads an object's generation from it and conditions its next
write of the object on it (OCDBT's manifest), so without it a checkpoint's second array fails to
write ("Malformed StorageGeneration"); `serve` adds the header. (The emulator also ignores
ifGenerationMatch preconditions: exclusive creates are not enforced there.)

`python -m tests.gcs_emulator [--port=9023]` serves one for trying gs:// runs by hand:
STORAGE_EMULATOR_HOST=http://localhost:9023 python -m moetrain.main ... --workdir=gs://bucket/run
(buckets are created on first use)."""

import argparse
import http.server
import sys
import time
import types

EMULATOR = 'STORAGE_EMULATOR_HOST'


def _with_generation(download):
  def handler(request, response, storage, *args, **kwargs):
    download(request, response, storage, *args, **kwargs)
    try:
      obj = storage.get_file_obj(request.params['bucket_name'], request.params['object_id'])
    except Exception:  # (not found: the handler has answered 404)
      return
    response['x-goog-generation'] = str(obj['generation'])
    response['x-goog-metageneration'] = str(obj['metageneration'])

  return handler


class _QuietHTTPServer(http.server.HTTPServer):
  def handle_error(self, request, client_address):
    """A client that hung up early (fsspec closing a read-ahead) is not an error worth a
    traceback on stderr; others are."""
    if not isinstance(sys.exc_info()[1], ConnectionError):
      super().handle_error(request, client_address)


def _patch_downloads() -> None:
  from gcp_storage_emulator import server
  from gcp_storage_emulator.handlers import objects

  server.server = types.SimpleNamespace(HTTPServer=_QuietHTTPServer)  # (what its thread makes)

  if getattr(objects.download, 'with_generation', False):
    return
  download = _with_generation(objects.download)
  download.with_generation = True
  for _, handlers in server.HANDLERS:
    for method, handler in handlers.items():
      if handler is objects.download:
        handlers[method] = download
  objects.download = download  # (objects.get calls it for ?alt=media)


def serve(port: int = 0, buckets=()):
  """A started in-memory emulator on localhost (port 0: a free one); returns (server, url)."""
  import socket

  from gcp_storage_emulator.server import create_server

  if not port:
    with socket.socket() as s:
      s.bind(('localhost', 0))
      port = s.getsockname()[1]
  _patch_downloads()
  server = create_server('localhost', port, in_memory=True, default_bucket=None)
  server.start()
  url = f'http://localhost:{port}'
  for bucket in buckets:
    make_bucket(url, bucket)
  return server, url


def make_bucket(url: str, bucket: str) -> None:
  import json
  import urllib.request

  request = urllib.request.Request(
    f'{url}/storage/v1/b?project=test',
    data=json.dumps({'name': bucket}).encode(),
    headers={'Content-Type': 'application/json'},
    method='POST',
  )
  urllib.request.urlopen(request).read()


if __name__ == '__main__':
  parser = argparse.ArgumentParser()
  parser.add_argument('--port', type=int, default=9023)
  parser.add_argument('--bucket', action='append', default=['bucket'])
  args = parser.parse_args()
  server, url = serve(args.port, args.bucket)
  print(f'{EMULATOR}={url} (buckets: {", ".join(args.bucket)}); Ctrl-C stops it', flush=True)
  try:
    while True:
      time.sleep(3600)
  except KeyboardInterrupt:
    server.stop()
