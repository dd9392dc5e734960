"""The folders are the layers (tokenflow/__init__.py): each imports only
from its own layer and those below it, and the paper's core imports neither
vLLM nor Ray. Read from the source, so a lazy import inside a function
counts too."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "tokenflow"
LAYER = {"core": 0, "kv_offload": 1, "engine": 2, "serve": 3, "tools": 4}


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "tokenflow" and len(parts) > 1 and parts[1] in LAYER else None


def test_every_module_is_in_a_layer():
    loose = [p.name for p in PKG.glob("*.py") if p.name != "__init__.py"]
    assert not loose, loose
    assert {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYER)


def test_imports_go_down_the_layers():
    wrong = []
    for path in PKG.rglob("*.py"):
        own = path.relative_to(PKG).parts[0]
        for module in imports(path):
            other = layer_of(module)
            if other is not None and other != own and LAYER[other] >= LAYER[own]:
                wrong.append(f"{path.relative_to(PKG)} imports {module}")
            if own == "core" and module.split(".")[0] in ("vllm", "ray", "torch"):
                wrong.append(f"{path.relative_to(PKG)} imports {module} (the core is pure Python)")
    assert not wrong, wrong
