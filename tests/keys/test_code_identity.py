from mixquant.keys.code_identity import module_identity, normalized_source

BASE = '''
"""Module docstring."""

def scale(x, factor=2.0):
    """Scale x."""
    # a comment
    return x * factor
'''

COSMETIC = '''
"""A reworded module docstring."""


def scale(
    x,
    factor=2.0,
):
    """Scale x by a factor (reworded)."""
    # a different comment

    return x * factor  # trailing
'''

NUMERICS_CONSTANT = BASE.replace("2.0", "2.5")
NUMERICS_OPERATOR = BASE.replace("x * factor", "x / factor")
NUMERICS_INDENT = """
def scale(x, factor=2.0):
    if x:
        x = x + 1
    return x * factor
"""
NUMERICS_INDENT_MOVED = """
def scale(x, factor=2.0):
    if x:
        x = x + 1
        return x * factor
"""


def test_cosmetic_edits_keep_identity():
    assert normalized_source(BASE) == normalized_source(COSMETIC.replace(",\n)", "\n)"))


def test_trailing_comma_from_formatter_is_a_token_change_we_accept():
    # Documented limitation: a formatter adding a magic trailing comma changes the token stream.
    assert normalized_source(BASE) != normalized_source(COSMETIC)


def test_numerics_edits_change_identity():
    base = normalized_source(BASE)
    assert normalized_source(NUMERICS_CONSTANT) != base
    assert normalized_source(NUMERICS_OPERATOR) != base
    assert normalized_source(NUMERICS_INDENT) != normalized_source(NUMERICS_INDENT_MOVED)


def test_module_identity_is_stable_hex():
    first = module_identity("mixquant.keys.canonical")
    assert len(first) == 64 and first == module_identity("mixquant.keys.canonical")
