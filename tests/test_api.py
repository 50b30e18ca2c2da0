"""The Python API's documented example runs as written."""

import doctest

import zsim


def test_package_docstring_example():
    result = doctest.testmod(zsim, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0
