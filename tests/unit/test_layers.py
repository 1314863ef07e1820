"""The layer order of docs/architecture.md holds: no module imports a higher layer, no import cycle."""

from __future__ import annotations

from detaudit.devtools.imports import check, cycles


def test_the_package_respects_its_layers():
    assert check() == []


def test_an_upward_import_and_a_cycle_are_found(tmp_path):
    pkg = tmp_path / "detaudit"
    (pkg / "builtin").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("from detaudit.cli import app\n")  # layer 0 importing the CLI
    (pkg / "cli.py").write_text("from detaudit import errors\n")
    (pkg / "builtin" / "__init__.py").write_text("")
    (pkg / "builtin" / "a.py").write_text("from detaudit.builtin import b\n")
    (pkg / "builtin" / "b.py").write_text("def f():\n    from .a import x\n")
    problems = check(pkg)
    assert "detaudit.errors (layer 0: errors) imports detaudit.cli (layer 10: cli)" in problems
    assert "import cycle: detaudit.cli -> detaudit.errors -> detaudit.cli" in problems
    assert "import cycle: detaudit.builtin.a -> detaudit.builtin.b -> detaudit.builtin.a" in problems


def test_kernels_sit_below_the_backends_and_the_model(tmp_path):
    """`backends.kernels` is a layer of its own: a kernel importing its backend, or the built-in model
    importing a kernel (the model asks its backend), is an upward import / a skipped layer."""
    pkg = tmp_path / "detaudit"
    for d in ("backends/kernels", "builtin"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "backends" / "bio.py").write_text("from detaudit.backends.kernels import fixed\n")
    (pkg / "backends" / "kernels" / "fixed.py").write_text("from detaudit.backends import bio\n")
    (pkg / "builtin" / "moe.py").write_text("from detaudit.backends.kernels import fixed\n")
    problems = check(pkg)
    assert (
        "detaudit.backends.kernels.fixed (layer 2: backends.kernels) imports detaudit.backends.bio (layer 3: backends)"
        in problems
    )
    assert "detaudit.builtin.moe (layer 4: builtin) imports detaudit.backends.kernels.fixed, a kernel" in problems


def test_cycles_reports_each_once():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c", "a"]]
