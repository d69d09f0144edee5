"""The repository's text: links that resolve, no import circles, and a project that speaks of
itself."""

import ast
import pathlib
import re
import subprocess

REPO = pathlib.Path(__file__).parent.parent
LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')


def _anchor(heading: str) -> str:
  """GitHub's anchor for a markdown heading: lower case, spaces to '-', punctuation dropped."""
  text = re.sub(r'[`*_]', '', heading.strip().lower())
  return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def _anchors(path: pathlib.Path) -> set[str]:
  found, seen = set(), {}
  in_code = False
  for line in path.read_text().splitlines():
    if line.startswith('```'):
      in_code = not in_code
    elif not in_code and (m := re.match(r'#+ (.*)', line)):
      base = _anchor(m.group(1))
      n = seen.get(base, 0)
      seen[base] = n + 1
      found.add(base if n == 0 else f'{base}-{n}')
  return found


def test_readme_and_docs_links_resolve():
  pages = [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md'))]
  broken = []
  for page in pages:
    for target in LINK.findall(page.read_text()):
      if re.match(r'[a-z]+://|mailto:', target):
        continue
      path, _, anchor = target.partition('#')
      dest = (page.parent / path).resolve() if path else page
      if not dest.exists():
        broken.append(f'{page.relative_to(REPO)}: {target} (no such file)')
      elif anchor and dest.suffix == '.md' and anchor not in _anchors(dest):
        broken.append(f'{page.relative_to(REPO)}: {target} (no such heading)')
  assert not broken, broken


def test_every_docs_page_is_linked_from_the_readme_or_another_page():
  pages = sorted((REPO / 'docs').glob('*.md'))
  linked = {
    (page.parent / t.partition('#')[0]).resolve()
    for page in [REPO / 'README.md', *pages]
    for t in LINK.findall(page.read_text())
    if not re.match(r'[a-z]+://', t) and t.partition('#')[0]
  }
  orphans = [p.name for p in pages if p.resolve() not in linked]
  assert not orphans, orphans


def _tracked() -> list[str]:
  out = subprocess.run(['git', 'ls-files'], cwd=REPO, capture_output=True, text=True)
  return out.stdout.split() if out.returncode == 0 else []


def test_no_tracked_text_tells_how_the_work_was_organised():
  hits = []
  for name in _tracked():
    path = REPO / name
    if (
      path.suffix not in ('.py', '.md', '.sh', '.toml', '.ipynb', '.txt', '') or not path.is_file()
    ):
      continue
    for i, line in enumerate(path.read_text(errors='replace').splitlines(), 1):
      if re.search(r'\bsessions? \d+', line, re.IGNORECASE):
        hits.append(f'{name}:{i}')
  assert not hits, hits
  assert not [n for n in _tracked() if n.endswith('.whl')]


def _module_imports() -> dict[str, set[str]]:
  """moetrain's modules and the moetrain modules each imports, at its top or inside a function
  (a deferred import hides a circle from the interpreter, not from the reader)."""
  root = REPO / 'moetrain'
  modules = {}
  for path in root.rglob('*.py'):
    parts = path.relative_to(REPO).with_suffix('').parts
    modules['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = path
  graph = {}
  for name, path in modules.items():
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        deps.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        deps.add(node.module)
        deps.update(f'{node.module}.{a.name}' for a in node.names)
    graph[name] = {d for d in deps if d in modules and d != name}
  return graph


def test_no_import_circle_among_moetrains_modules():
  graph = _module_imports()
  state, circles = {}, []

  def visit(node, stack):
    state[node] = 'open'
    for dep in sorted(graph[node]):
      if state.get(dep) == 'open':
        circles.append(' -> '.join(stack[stack.index(dep) :] + [dep]))
      elif dep not in state:
        visit(dep, stack + [dep])
    state[node] = 'done'

  for node in sorted(graph):
    if node not in state:
      visit(node, [node])
  # A package's __init__ importing its own submodules is not a circle.
  circles = [
    c for c in circles if not all(p.startswith(c.split(' -> ')[0]) for p in c.split(' -> '))
  ]
  assert not circles, circles
