"""The README's Python blocks run as written (each in a fresh namespace, from an empty working directory)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import needs_smollm2

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks() -> list[tuple[int, str]]:
    """(line number of the block's first line, code) for every ```python block of the README."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


def cases() -> list[object]:
    out = []
    for line, code in python_blocks():
        marks = [needs_smollm2] if "smollm2" in code else []
        out.append(pytest.param(line, code, marks=marks, id=f"README.md:{line}"))
    return out


def test_the_readme_has_its_python_examples():
    codes = [code for _, code in python_blocks()]
    assert codes[0].lstrip().startswith("import kvload") and "kvload.LLM(" in codes[0]  # the front door first
    assert any("generate_stream" in c for c in codes) and any("PagedBatch.build" in c for c in codes)


@pytest.mark.parametrize(("line", "code"), cases())
def test_a_readme_python_block_runs(line, code, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # blocks may write files (serve.yaml)
    # padded so a traceback points at the README's own line numbers
    exec(compile("\n" * (line - 1) + code, str(README), "exec"), {"__name__": "__readme__"})


def test_a_user_package_named_like_a_kvload_layer_shadows_it_as_the_readme_says(tmp_path):
    import subprocess
    import sys
    import tomllib

    include = tomllib.loads((README.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    names = sorted(p.rstrip("*") for p in include["include"])
    limitation = next(p for p in README.read_text().split("\n- ") if "top-level packages" in p)
    assert all(f"`{name}`" in limitation for name in names)  # the README names every package kvload installs
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("")
    code = "import kvload; kvload.plan('tiny-llama', log=False)"
    env = {"PYTHONPATH": str(README.parent), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=env)
    # what the README's limitation describes: one ImportError naming both directories
    assert r.returncode != 0 and "kvload cannot import its own top-level package 'models'" in r.stderr


# --- what the README names exists: sections, paths, modules, flags, fields, events ------------------------------

ROOT = README.parent
FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
KVLOAD_COMMANDS = ("plan", "run", "generate", "serve", "simulate", "explain", "audit", "models")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


def norm(text: str) -> str:
    """Text as a cross-reference matches it: no backticks, whitespace collapsed, lower case."""
    return " ".join(text.replace("`", "").split()).lower()


def headings(text: str) -> list[str]:
    """Every Markdown heading of ``text`` (outside code blocks), normalized."""
    return [norm(h) for h in re.findall(r"^#+ (.*)$", FENCED.sub("", text), re.M)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def code_spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks (a span may wrap onto the next line) and every fenced block's lines."""
    spans = re.findall(r"`([^`\n]+(?:\n[^`\n]+)?)`", FENCED.sub("", text))
    return spans + [line for block in FENCED.findall(text) for line in block.replace("\\\n", " ").splitlines()]


def section(text: str, title: str) -> str:
    """The body of the ``##`` section whose heading starts with ``title``."""
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def subcommand_flags() -> dict[str, set[str]]:
    """Every option string of each ``kvload`` subcommand."""
    import argparse

    from kvload.cli.commands import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {o for a in p._actions for o in a.option_strings} for name, p in sub.choices.items()}


def test_the_readme_anchors_name_its_headings():
    text = README.read_text()
    anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", FENCED.sub("", text), re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links and [a for a in links if a not in anchors] == []


def test_the_readme_cross_references_name_sections_that_exist():
    text = README.read_text()
    own = headings(text) + [norm(b) for b in re.findall(r"\*\*(?=\S)([^*\n]+?)(?<=\S)\*\*", text)]  # bold leads
    bench = headings((ROOT / "BENCHMARKS.md").read_text())
    seen = re.findall(r'[Ss]ee\s+"([^"]+)"', text) + re.findall(r'\("([A-Z][^"]{3,80})"\)', text)
    cited = []
    for first, more in re.findall(r'BENCHMARKS\.md[,;]?\s+\(?"([^"]+)"((?:,? (?:and )?"[^"]+")*)', text):
        cited += [first, *re.findall(r'"([^"]+)"', more)]
    assert len(seen) > 20 and len(cited) > 20
    assert [r for r in seen if not any(norm(r) in h for h in own + bench)] == []  # a README section (or bold lead)
    assert [r for r in cited if not any(norm(r) in h for h in bench)] == []  # a BENCHMARKS.md section


def test_the_files_the_readme_names_exist():
    text = README.read_text()
    # a path alone in a span, or a word of a command line (kvload simulate tests/data/configs/...); a path out of the
    # repository (../configs/...) is on no fresh clone
    top = r"(?:\.\./)*(?:kvload|engine|stages|pipeline|models|cache_backends|tests|bench|scripts|docs)/"
    paths = {s for s in code_spans(text) if re.fullmatch(top + r"[\w./*-]*", s)}
    paths |= {w for s in code_spans(text) for w in s.split() if re.fullmatch(top + r"[\w./-]+", w)}
    paths |= {w for s in code_spans(text) for w in s.split() if w.startswith("../")}
    modules = set(re.findall(r"python -m (bench\.\w+|kvload)\b", text))
    assert len(paths) > 10 and len(modules) > 10
    assert [p for p in sorted(paths) if p.startswith("../") or not any(ROOT.glob(p.rstrip("/")))] == []
    assert [m for m in sorted(modules) if not (ROOT / (m.replace(".", "/") + ".py")).is_file()
            and not (ROOT / m / "__main__.py").is_file()] == []


def defines(package: Path, name: str) -> bool:
    """Whether a module of ``package`` (or below) defines ``name`` (a class, function or assignment)."""
    pattern = re.compile(rf"^\s*(?:class|def) {name}\b|^{name}\b\s*[:=]", re.M)
    return any(pattern.search(f.read_text()) for f in package.rglob("*.py"))


def resolves(package: str, dotted: str) -> bool:
    """Whether ``dotted`` (``module.attr``, ``Class.attr``, ``Class`` or a top-level ``package.attr``) names something
    in ``package``: a module of it, a class one of its modules defines (or re-exports), or a top-level package."""
    import importlib

    head, *rest = dotted.split(".")
    starts = []
    for name in (f"{package}.{head}", head):
        with contextlib.suppress(ModuleNotFoundError):
            starts.append(importlib.import_module(name))
    starts.append(getattr(importlib.import_module(package), head, None))  # kvload's lazy re-exports
    for path in sorted((ROOT / package).rglob("*.py")):
        reexport = path.name == "__init__.py" and re.search(rf"^from \S+ import .*\b{head}\b", path.read_text(), re.M)
        if reexport or re.search(rf"^class {head}\b", path.read_text(), re.M):
            module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
            starts.append(getattr(module, head, None))
    for obj in starts:
        for attr in rest:
            obj = getattr(obj, attr, None)
        if obj is not None:
            return True
    return False


def test_where_things_are_names_modules_that_exist():
    rows = [r for r in section(README.read_text(), "Where things are").splitlines() if r.startswith("| ")]
    layers = [r.split("|")[1:4] for r in rows if re.match(r"\| \w+ \| `\w+/` \|", r)]
    assert {cells[1].strip() for cells in layers} == {f"`{p}/`" for p in
                                                       ("kvload", "engine", "stages", "pipeline", "models",
                                                        "cache_backends")}
    missing = []
    for _, package_cell, holds in layers:
        package = ROOT / package_cell.strip(" `/")
        dirs = [package] + [package / d.rstrip("/") for d in re.findall(r"`(\w+/)`", holds)]
        for name in re.findall(r"`([^`]+)`", holds):
            name = name.removesuffix("()")
            if name.endswith("/"):
                ok = (package / name).is_dir() or (ROOT / name).is_dir()
            elif re.fullmatch(r"[a-z_][a-z0-9_]*\*?", name):  # a module of the layer (or a function in one)
                ok = any(list(d.glob(name + ".py")) or (d / name).is_dir() for d in dirs) or defines(package, name)
            elif re.fullmatch(r"\w+(?:\.\w+)+|[A-Z]\w+", name):  # module.attr, Class(.method), kvload.NAME
                ok = resolves(package.name, name)
            else:
                ok = True  # a command line (python -m kvload)
            if not ok:
                missing.append(f"{package_cell.strip()}: {name}")
    assert missing == []
    folders = [r.split("|")[1:3] for r in rows if re.match(r"\| `\w+/` \|", r)]
    named = [(f.strip(" `"), n) for f, holds in folders for n in re.findall(r"`([\w.-]+\.(?:py|sh|md))`", holds)]
    assert len(folders) == 4 and [n for f, n in named if not (ROOT / f / n).is_file()] == []


# flags the README names that belong to no kvload command: other programs', and ones it shows being refused
NOT_KVLOAD_FLAGS = {
    "--nproc-per-node": "torchrun's",
    "--no-deps": "pip's",
    "--index-url": "pip's",
    "--unix-socket": "curl's (reaching serve --uds)",
    "--gpu-memory-utilization": "vLLM's, refused (Coming from vLLM)",
    "--swap-space": "vLLM's, refused (Coming from vLLM)",
    "--num-gpu-blocks-override": "vLLM's, refused (Coming from vLLM)",
    "--kv-cache-memory-bytes": "vLLM's, refused (Coming from vLLM)",
    "--max_tok": "an abbreviation, shown refused",
    "--api-keyy": "a typo, shown refused with its value hidden",
    "--hf-tokenn": "a typo of a secret flag, its value hidden",
}


def test_every_flag_the_readme_names_exists():
    text = README.read_text()
    commands = subcommand_flags()
    known = set().union(*commands.values())
    # a flag of a bench or a script (python -m bench.X, python scripts/X.py) is that program's
    bench = "\n".join(f.read_text() for d in ("bench", "scripts") for f in (ROOT / d).glob("*.py"))
    unknown = sorted(f for f in set(FLAG.findall(text))
                     if f not in known and f not in NOT_KVLOAD_FLAGS and f'"{f}"' not in bench)
    assert unknown == []
    wrong = []  # a flag shown on a kvload command line must be that command's
    for span in code_spans(text):
        for m in re.finditer(rf"\bkvload ({'|'.join(KVLOAD_COMMANDS)})\b([^|;]*)", span):
            wrong += [f"kvload {m[1]} {f}" for f in FLAG.findall(m[2])
                      if f not in commands[m[1]] and f not in NOT_KVLOAD_FLAGS]
        for m in re.finditer(r"python -m bench\.(\w+)([^|;]*)", span):
            source = (ROOT / "bench" / f"{m[1]}.py").read_text()
            wrong += [f"bench.{m[1]} {f}" for f in FLAG.findall(m[2]) if f'"{f}"' not in source]
    assert wrong == []


def test_every_kvload_flag_is_in_the_readme():
    text = README.read_text()
    named = set(FLAG.findall(text))
    left_out = []
    for command, flags in subcommand_flags().items():
        long_flags = {f for f in flags if f.startswith("--")} - {"--help"}
        # a flag counts as named when one of its spellings is (the parser has dashed and underscored ones)
        spellings = {f: {f, f.replace("_", "-"), f.replace("-", "_").replace("__", "--")} for f in long_flags}
        for f, s in spellings.items():  # vLLM's --no-X of a switch the README names (it says the --no- forms are taken)
            if f.replace("_", "-").startswith("--no-"):
                s |= {"--" + f[5:].replace("_", "-"), "--" + f[5:].replace("-", "_")}
        left_out += [f"{command} {f}" for f, s in sorted(spellings.items()) if not s & named]
    assert left_out == []


def _type_words(path: str, attribute: Any) -> list[str]:
    """Words a field's type cell must hold, from its annotation."""
    from pipeline.config import AUTO

    kind = str(attribute.type)
    words = {"int": ["int"], "float": ["float"], "bool": ["bool"], "Bytes": ["bytes"],
             "TriState": ["bool", '"auto"']}.get(kind.split(" |")[0], [])
    if "None" in kind:
        words.append("null")
    if attribute.default == AUTO:
        words.append('"auto"')
    if path == "kv_cache_config.dtype":
        words.append("float8")
    return words


def test_the_config_table_matches_the_classes_and_the_cli():
    import attrs

    from cache_backends.request import SCHEDULING_POLICY_NAMES
    from kvload.cli.flags import FLAGS
    from pipeline.config import (
        ATTENTION_BACKENDS,
        LINEAR_BACKENDS,
        MODEL_DTYPES,
        GenerationDefaults,
        KvCacheConfig,
        LlmArgs,
        public_fields,
    )

    body = section(README.read_text(), "Python API")
    table = {}
    for row in body.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            table[cells[0].strip("`")] = cells[1:]
    fields = {a.name: a for a in public_fields(LlmArgs) if a.name != "kv_cache_config"}
    fields |= {f"kv_cache_config.{a.name}": a for a in public_fields(KvCacheConfig)}
    assert list(table) == list(fields)  # every field, in the classes' order, and no other
    flag_of = {}
    for flag in FLAGS:
        flag_of.setdefault(flag.path, flag.name)
    choices = {"dtype": MODEL_DTYPES, "attention_backend": ATTENTION_BACKENDS, "linear_backend": LINEAR_BACKENDS,
               "scheduling_policy": SCHEDULING_POLICY_NAMES}
    wrong = []
    for path, (kind, default, flag) in table.items():
        a = fields[path]
        if a.default is attrs.NOTHING:
            shown = "(required)"
        elif isinstance(a.default, attrs.Factory):
            shown = "`{}`"  # a mapping of unset keys
        else:
            shown = (f'`"{a.default}"`' if isinstance(a.default, str) else "`null`" if a.default is None else
                     f"`{str(a.default).lower()}`" if isinstance(a.default, bool) else f"`{a.default}`")
        if default != shown:
            wrong.append(f"{path}: default {default}, the class says {shown}")
        words = _type_words(path, a) + [f"`{c}`" for c in choices.get(path, ()) if c != "auto"]
        if path == "override_generation_config":
            words += [f"`{g.name}`" for g in public_fields(GenerationDefaults)]
        wrong += [f"{path}: type {kind!r} does not say {w}" for w in words if w not in kind]
        expected = "MODEL" if path == "model" else f"`{flag_of[path]}`" if path in flag_of else "—"
        if flag != expected:
            wrong.append(f"{path}: flag {flag}, the CLI's is {expected}")
    assert wrong == []


EVENTISH = re.compile(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`(?=\s+(?:event|events|warning|warnings|record)\b)")


def test_every_event_the_readme_names_is_one_kvload_emits():
    from pipeline.events import EVENT_TYPES

    text = README.read_text()
    named = set(EVENTISH.findall(text))
    for first, rest in re.findall(r"`([a-z]+)_[a-z]+`((?:/`_[a-z]+`)+)", text):  # `request_admitted`/`_suspended`
        named |= {first + suffix for suffix in re.findall(r"`(_[a-z]+)`", rest)}
    beyond = section(text, "Where kvload departs from DESIGN.md").split("**Events beyond DESIGN.md's list:**")[1]
    beyond = beyond.split("Value-changing events are exactly")[0]
    # the list's entries: each name that opens an entry (the parenthesised words after it are fields and examples)
    named |= {n for n in re.findall(r"`([a-z][a-z_]+)`", re.sub(r"\([^()]*(?:\([^()]*\)[^()]*)*\)", "", beyond))}
    assert len(named) > 25
    assert sorted(n for n in named if n not in EVENT_TYPES) == []


def test_the_stage_diagram_is_the_pipelines_order():
    from stages import load_stages, plan_stages

    diagram = FENCED.findall(section(README.read_text(), "How it loads"))[0]
    shown = re.findall(r"\b[a-z]+(?:_[a-z]+)+\b", re.sub(r"\([^)]*\)", "", diagram))  # the notes left out
    plan, load = [s.name for s in plan_stages()], [s.name for s in load_stages()]
    # plan's stages, then the ones load runs in place of plan's last (plan_kv)
    assert shown == plan + [name for name in load if name not in plan]
    assert load == plan[:-1] + [name for name in load if name not in plan]


# the console blocks a test can replay in a few seconds: plan/run/explain/audit/simulate of presets (no weights; the
# simulations' step counts and hit rates are deterministic, their timings are left out as "...")
REPLAYED = ("plan", "run", "explain", "audit", "simulate")


def console_sessions(text: str) -> list[tuple[str, list[str]]]:
    """Each ``$ kvload ...`` line of the README's console blocks with the output lines shown under it."""
    sessions: list[tuple[str, list[str]]] = []
    for block in re.findall(r"^```console\n(.*?)^```", text, re.S | re.M):
        for line in block.splitlines():
            if line.startswith("$ "):
                sessions.append((line[2:], []))
            elif sessions:
                sessions[-1][1].append(line.rstrip())
    return sessions


def test_the_readmes_plan_run_explain_audit_sessions_print_what_it_shows(tmp_path, monkeypatch, capsys):
    import json
    import shlex

    from tests.cli_support import run_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CC", "cc")  # the runs shown were on a machine with a C compiler (linear_backend's reason)
    replayed = 0
    for command, shown in console_sessions(README.read_text()):
        if not command.startswith("kvload "):
            continue
        words = shlex.split(command.split(";")[0].split(">")[0])
        files = [w for w in words if w.endswith(".jsonl")]
        if files == ["tampered.jsonl"] and Path("v4.jsonl").exists():  # the edit the README describes
            tampered = [json.loads(line) for line in Path("v4.jsonl").read_text().splitlines()]
            for record in tampered:
                if record.get("event") == "auto_resolved" and record["field"].endswith("use_kv_cache_manager_v2"):
                    record["new"] = False
            Path("tampered.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tampered))
        if words[1] not in REPLAYED or "smollm2-135m" in words or (
                words[1] in ("explain", "audit") and not all(Path(f).exists() for f in files)):
            continue
        result = run_cli(capsys, *words[1:])
        printed = [] if ">" in command else result.out.splitlines()
        printed = [line.rstrip() for line in printed + result.err.splitlines()]
        if 'echo "exit $?"' in command:
            printed.append(f"exit {result.code}")
        else:
            assert result.code == 0, (command, result.err)
        at = 0  # every line shown, in order ("..." stands for lines left out)
        for line in shown:
            if line.strip() in ("...", ""):
                continue
            assert line in printed[at:], f"README's `{command}` shows {line!r}, which kvload did not print"
            at = printed.index(line, at) + 1
        replayed += 1
    # the walk-through's run, explain, audit, tampered audit, refused route; plan --compare; the two simulations
    assert replayed >= 8


def test_the_audit_lines_that_are_not_events_are_named_where_the_readme_departs_from_design():
    """DESIGN.md: every event has ``event``, ``stage`` and ``seq``. The lines kvload writes without them (the file's
    header, the served log's marker of records let go) are a departure, so the section that lists departures names
    each (it named the header only)."""
    from pipeline.audit import DROPPED_EVENT, HEADER_EVENT, dropped_record, header_record

    for record in (header_record(), dropped_record(3, kept=5, keep=5)):
        assert "stage" not in record and "seq" not in record
    departures = section(README.read_text(), "Where kvload departs from DESIGN.md")
    assert [name for name in (HEADER_EVENT, DROPPED_EVENT) if f"`{name}`" not in departures] == []


def test_every_event_kvload_emits_is_in_designs_list_or_the_readmes():
    from pipeline.events import EVENT_TYPES

    design = (ROOT.parent / "shared" / "DESIGN.md")
    if not design.is_file():
        pytest.skip("DESIGN.md is not beside this checkout")
    text = design.read_text().split("Names are a public contract")[1].split("Value-changing")[0]
    listed = set(re.findall(r"`([a-z_]+)`", text))
    beyond = README.read_text().split("**Events beyond DESIGN.md's list:**")[1].split("Value-changing events are")[0]
    named = set(re.findall(r"`([a-z][a-z_]+)`", beyond))
    for first, rest in re.findall(r"`([a-z]+)_[a-z]+`((?:/`_[a-z]+`)+)", beyond):  # `request_admitted`/`_suspended`
        named |= {first + suffix for suffix in re.findall(r"`(_[a-z]+)`", rest)}
    assert sorted(set(EVENT_TYPES) - listed - named) == []


def test_the_sampling_params_table_names_every_field():
    import attrs

    from engine.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams

    text = README.read_text()
    start = text.index("| `SamplingParams` field |")
    rows = text[start:text.index("\n\n", start)].splitlines()[2:]
    named = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    fields = {a.name for a in attrs.fields(SamplingParams) if not a.name.startswith("_")}
    assert named - fields == {"max_new_tokens"}  # max_tokens' alias, which the row says
    assert sorted(fields - named) == []
    assert f"default {DEFAULT_MAX_TOKENS}" in rows[0] and SamplingParams(max_new_tokens=5).max_tokens == 5


def test_the_serve_table_lists_every_endpoint_the_app_has():
    source = (ROOT / "kvload" / "serve" / "app.py").read_text()
    decorated = re.findall(r'@app\.(get|post|delete)\("([^"]+)"\)', source)
    routes = {f"{m.upper()} {re.sub(r'{[^}]*}', '{}', p)}" for m, p in decorated}
    body = section(README.read_text(), "Serve")
    start = body.index("| endpoint | what |")
    table = body[start:body.index("\n\n", start)]
    named = {re.sub(r"{[^}]*}", "{}", e.split("?")[0]) for row in table.splitlines()[2:]
             for e in re.findall(r"`((?:GET|POST|DELETE) /[^`\s]*)`", row.split("|")[1])}
    assert len(routes) > 15
    assert sorted(routes - named) == [] and sorted(named - routes) == []


def test_the_dotted_names_the_readme_gives_resolve():
    import importlib

    text = README.read_text()
    layer = r"(?:kvload|engine|pipeline|stages|models|cache_backends)"
    names = set(re.findall(rf"`({layer}(?:\.\w+)+)(?:\([^`]*\))?`", text))  # a call's arguments left out
    unresolved = []
    for name in sorted(names):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):  # the longest module prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ModuleNotFoundError:
                continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        if obj is None:
            unresolved.append(name)
    assert len(names) > 10 and unresolved == []


def test_the_deepseek_v4_simulations_the_readme_quotes_give_its_figures(tmp_path, monkeypatch, capsys):
    """"How it loads" quotes `kvload simulate tiny-deepseek-v4 --workload multi-turn`: the split's figures, then the
    slab arena's. It gave the split's for the bare command after "auto" began to pick the arena there (64 at once in
    575 steps, not 52 in 1,038)."""
    from tests.cli_support import run_cli

    monkeypatch.chdir(tmp_path)
    text = norm(section(README.read_text(), "How it loads"))
    command = "kvload simulate tiny-deepseek-v4 --workload multi-turn"
    for flags, said in ((["--pool_arena", "false"], "now {at_once} ({steps:,} steps, {hit:.1%})"),
                        ([], "without --pool_arena false that budget takes the slab arena below (\"auto\"): "
                             "{at_once} at once, {steps:,} steps, {hit:.1%}")):
        assert norm(" ".join([command, *flags])) in text
        result = run_cli(capsys, *command.split()[1:], *flags, "--json")
        assert result.code == 0, result.err
        (run,) = result.json()["results"].values()
        shown = said.format(at_once=run["max_concurrency"], steps=run["steps"], hit=run["hit_rate"])
        assert norm(shown) in text, shown
