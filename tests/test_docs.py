"""The repository's text: links that resolve, no import circles, and a project that speaks of
itself."""

import ast
import importlib
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
  return {anchor for _, anchor in _headings(path)}


def test_readme_and_docs_links_resolve():
  pages = [
    REPO / 'README.md',
    *sorted((REPO / 'docs').glob('*.md')),
    REPO / 'bench' / 'RESULTS.md',
    REPO / 'bench' / 'HISTORY.md',
  ]
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


def _headings(path: pathlib.Path) -> list[tuple[str, str]]:
  """Each heading's text and its anchor, in order (a repeated heading's anchor numbered)."""
  heads, seen, in_code = [], {}, False
  for line in path.read_text().splitlines():
    if line.startswith('```'):
      in_code = not in_code
    elif not in_code and (m := re.match(r'#+ (.*)', line)):
      base = _anchor(m.group(1))
      n = seen.get(base, 0)
      seen[base] = n + 1
      heads.append((m.group(1).strip(), base if n == 0 else f'{base}-{n}'))
  return heads


# A quoted section of bench/RESULTS.md: `RESULTS.md, "Title"`, `RESULTS.md "Title"` or
# `RESULTS.md ("Title"`, the title possibly broken over lines.
CITATION = re.compile(r'RESULTS\.md,?\s*\(?"([^"]+)"')


def _joined(path: pathlib.Path) -> str:
  """The file's text with its line breaks (and a comment's leading '#') turned into spaces, so
  that a citation broken over lines reads as one."""
  text = path.read_text()
  if path.suffix == '.py':
    return re.sub(r'[ \t]*\n[ \t]*(#[ \t]*)?', ' ', text)
  return re.sub(r'[ \t]*\n[ \t]*', ' ', text)


def test_every_results_citation_names_a_section_and_links_to_it():
  """A quoted title of bench/RESULTS.md names one of its headings (the heading or its start),
  and in a markdown page it is the text of a link to that heading. docs/config.md is generated
  from the code's comments, so there only the title is checked."""
  results = REPO / 'bench' / 'RESULTS.md'
  heads = _headings(results)
  files = [
    REPO / 'README.md',
    *sorted((REPO / 'docs').glob('*.md')),
    *sorted((REPO / 'moetrain').rglob('*.py')),
    *sorted((REPO / 'bench').glob('*.py')),
    *sorted((REPO / 'configs').glob('*.py')),
  ]
  stale, unlinked = [], []
  for path in files:
    text = _joined(path)
    links = [
      (m.start(), m.end(), m.group(2)) for m in re.finditer(r'\[([^\]]*)\]\(([^)\s]+)\)', text)
    ]
    for m in CITATION.finditer(text):
      title = re.sub(r'\s+', ' ', m.group(1)).strip()
      named = [a for h, a in heads if h == title or h.startswith(title)]
      where = f'{path.relative_to(REPO)}: "{title}"'
      if not named:
        stale.append(where)
        continue
      if path.suffix != '.md' or path == REPO / 'docs' / 'config.md':
        continue
      targets = [t for s, e, t in links if s <= m.start() and m.end() <= e]
      if not any(
        t.partition('#')[0].endswith('RESULTS.md') and t.partition('#')[2] in named for t in targets
      ):
        unlinked.append(where)
  assert not stale, f'no such heading in bench/RESULTS.md: {stale}'
  assert not unlinked, f'not inside a link to its heading of bench/RESULTS.md: {unlinked}'


# The README's name for each family of the registry (its model_type).
FAMILY_NAMES = {
  'longcat_flash': 'LongCat-Flash',
  'deepseek_v3': 'DeepSeek-V3',
  'qwen3_moe': 'Qwen3-MoE',
  'mixtral': 'Mixtral',
  'olmoe': 'OLMoE',
  'qwen2_moe': 'Qwen2-MoE',
  'deepseek_v2': 'DeepSeek-V2',
  'glm4_moe': 'GLM-4.5',
  'gpt_oss': 'gpt-oss',
  'minimax_m2': 'MiniMax-M2',
  'qwen3_next': 'Qwen3-Next',
  'qwen3_5_moe_text': 'Qwen3.5-MoE',
  'deepseek_v32': 'DeepSeek-V3.2',
  'glm_moe_dsa': 'GLM-5',
}


def _model_types() -> tuple[str, ...]:
  """The registry's families: MODEL_TYPES, imported from the moetrain module that defines it."""
  for path in sorted((REPO / 'moetrain').rglob('*.py')):
    tree = ast.parse(path.read_text())
    if any(
      isinstance(node, ast.Assign)
      and any(isinstance(t, ast.Name) and t.id == 'MODEL_TYPES' for t in node.targets)
      for node in tree.body
    ):
      parts = path.relative_to(REPO).with_suffix('').parts
      name = '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)
      return tuple(importlib.import_module(name).MODEL_TYPES)
  raise AssertionError('no module of moetrain/ defines MODEL_TYPES')


def test_readme_names_exactly_the_registrys_families():
  """The README's family table has one row per registered model_type, and its opening names
  every family."""
  types = _model_types()
  unnamed = sorted(set(types) - set(FAMILY_NAMES))
  assert not unnamed, f'give these families a name in FAMILY_NAMES here: {unnamed}'
  readme = (REPO / 'README.md').read_text()
  section = readme.partition('\n## Model families\n')[2].partition('\n## ')[0]
  assert section, 'README.md has no "## Model families" section'
  table = [line for line in section.splitlines() if line.startswith('|')]
  body = table[2:]  # past the header and its |---| line
  rows = [m.group(1) for line in body if (m := re.match(r'\|[^|]*\(`(\w+)`\)', line))]
  assert len(rows) == len(body), f'a family row without its (`model_type`): {body}'
  missing = [f'{FAMILY_NAMES[t]} ({t})' for t in types if t not in rows]
  assert not missing, f"README.md's family table lacks a row for: {missing}"
  extra = [r for r in rows if r not in types]
  assert not extra, f"README.md's family table has rows for unregistered families: {extra}"
  assert len(rows) == len(set(rows)), f'a family has two rows: {rows}'
  opening = ' '.join(readme.partition('\n## ')[0].split())
  unnamed = [f'{FAMILY_NAMES[t]} ({t})' for t in types if FAMILY_NAMES[t] not in opening]
  assert not unnamed, f"README.md's opening does not name: {unnamed}"


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
