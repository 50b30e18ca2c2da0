"""The Python API: its documented example runs as written, and its public names import."""

import doctest

import zsim


def test_package_docstring_example():
    result = doctest.testmod(zsim, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0


def test_public_names_import():
    for name in zsim.__all__:
        assert getattr(zsim, name) is not None, name
    from zsim import presets  # noqa: F401  (the README's names)
    from zsim.cli import main
    from zsim.simulation import simulate
    from zsim.workload.parallel import ParallelConfig  # noqa: F401  (the README's names)

    assert callable(main)
    assert callable(simulate)


def test_console_script_entry_point_is_zsim_cli_main():
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["zsim"] == "zsim.cli:main"
