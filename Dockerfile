# moetrain for TPU hosts (GKE JobSets, xpk): Python 3.12, the package with its tpu extra, the
# repository's configs and the pods' command. Its entry point trains:
#   make image IMAGE=us-docker.pkg.dev/PROJECT/REPO/moetrain:TAG && docker push ...
#   docker run IMAGE --config=configs/longcat_lora.py --workdir=gs://bucket/runs/demo
# The manifests of `python -m moetrain.tools.launch` run tpu_scripts/pod_run.sh from it.
FROM python:3.12-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /moetrain
COPY pyproject.toml README.md ./
COPY moetrain ./moetrain
RUN pip install '.[tpu]'
COPY configs ./configs
COPY tpu_scripts/pod_run.sh ./tpu_scripts/

ENTRYPOINT ["python", "-m", "moetrain.main"]
