"""Fuzzing the descriptor validator (issue 8, item 5): mutate the corpus in
``dml_optim/data/shapes/descriptors/*.json`` and feed the library and the CLI.

The only acceptable outcomes are *valid* (exit 0), *violations* (exit 1, the
report on stdout, nothing on stderr) and *malformed input* (exit 2, exactly
one line on stderr).  Never another exception, never a traceback.  The CLI's
outcome must agree with the library's (``dml_optim.dml.loads`` + ``validate``).

Mutations: byte flips of the raw text, type swaps (number / string / list /
null / object / bool) at any place in the JSON tree, missing and extra
fields, huge (2**70, 1e300) and negative numbers, ``NaN`` / ``Infinity``
literals (which Python's json accepts), and deep nesting.

Example counts come from the hypothesis profile (``ci``: 60 per test;
``HYPOTHESIS_PROFILE=fuzz``: 5000 per test, the long maintainer run).
"""

from __future__ import annotations

import copy
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dml_optim.cli import main
from dml_optim.dml import MalformedDescriptor, loads, validate

CORPUS_DIR = Path(__file__).resolve().parent.parent / "dml_optim" / "data" / "shapes" / "descriptors"
CORPUS = sorted(CORPUS_DIR.glob("*.json"))
TEXTS = {p.name: p.read_bytes() for p in CORPUS}
PARSED = {}
for _name, _raw in TEXTS.items():
    try:
        PARSED[_name] = json.loads(_raw)
    except ValueError:
        pass  # malformed-not-json.json: only byte-level mutations apply to it

#: hypothesis draws a corpus file per example; files, paths and capsys need no reset between examples
FUZZ = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def test_corpus_is_there():
    assert len(CORPUS) >= 30, f"expected the descriptor corpus in {CORPUS_DIR}"
    assert len(PARSED) >= len(CORPUS) - 2


# -- outcome classification --------------------------------------------------------------


def library_outcome(text) -> int:
    """0 valid, 1 violations, 2 malformed; any other exception propagates (= a failure)."""
    try:
        desc = loads(text)
    except MalformedDescriptor as exc:
        assert str(exc).strip(), "a malformed-input error needs a reason"
        return 2
    report = validate(desc)
    for v in report.violations:
        assert v.rule and v.field and v.message, v
    return 0 if report.valid else 1


def cli_outcome(path: Path, capsys) -> int:
    capsys.readouterr()
    rc = main(["validate", str(path)])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert rc in (0, 1, 2), (rc, err)
    if rc == 2:
        assert err.count("\n") == 1 and err.startswith("dml-optim validate: error:"), err
    else:
        # the CLI turns unexpected exceptions into "error: <Type>: ..." with status 1: that is a crash here
        assert err == "", f"status {rc} with stderr {err!r}"
        assert ("valid at feature level" in out) if rc == 0 else ("INVALID" in out), out
    return rc


def check(raw: bytes, tmp_path: Path, capsys) -> int:
    expected = library_outcome(raw)
    path = tmp_path / "fuzzed.json"
    path.write_bytes(raw)
    assert cli_outcome(path, capsys) == expected
    return expected


# -- mutations ----------------------------------------------------------------------------------

ODD_VALUES = st.sampled_from([
    None, True, False, 0, -1, -(2**31), 2**32, 2**32 - 1, 2**64, 2**70, -(2**70), 10**400, 1e300, -1e300,
    0.5, -0.0, 5e-324, float("nan"), float("inf"), float("-inf"), "", "FLOAT32", "UINT32", "NONE",
    "OWNED_BY_DML", "3_0", "x" * 300, "\u0000", "\ud800", [], [1], [0], [-1], [2**70], [1.5], ["1"], [None],
    [[1]], {}, {"Sizes": [1]}, {"DataType": "FLOAT16"},
])


def paths(obj, prefix=()):
    """Every path (tuple of keys / indices) into a JSON tree, the root included."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from paths(v, prefix + (i,))


def get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def set_at(obj, path, value):
    if not path:
        return value
    get(obj, path[:-1])[path[-1]] = value
    return obj


def type_swap(value, choice: int):
    """A value of another JSON type derived from ``value``."""
    options = [
        len(value) if isinstance(value, (list, dict, str)) else value,  # -> number (or unchanged)
        json.dumps(value, allow_nan=True),                               # -> string
        [value],                                                         # -> list
        None,                                                            # -> null
        {"value": value},                                                # -> object
        bool(value) if not isinstance(value, float) or not math.isnan(value) else True,  # -> bool
    ]
    return options[choice % len(options)]


#: What each kind of mutation draws: the swap choice, the odd value, the (key, value) added, the factor.
MUTATIONS = {
    "swap": st.integers(0, 5),
    "odd": ODD_VALUES,
    "delete": st.none(),
    "extra": st.tuples(st.sampled_from(["Extra", "Sizes", "DataType", "Buffer", "", "DimensionCount", "\u00e9"]),
                       ODD_VALUES),
    "scale": st.sampled_from([2**70, 2**32, 1e300, 1e-300, 0.5, 3]),
    "negate": st.none(),
    "nest": st.none(),
}


def scaled(value, factor):
    """``value * factor``; an int too large for a float times a float is the exact product, rounded to an int.

    (``10**400 * 1e300`` converts the int to a float first and raises OverflowError.)
    """
    try:
        return value * factor
    except OverflowError:
        return round(Fraction(value) * Fraction(factor))


def mutate(obj, path, kind: str, arg):
    """``obj`` with one mutation of ``kind`` (a key of MUTATIONS) at ``path``; never raises.

    Drawn values are deep-copied, so that mutating them later in the same
    example never changes ODD_VALUES (which would make hypothesis's data
    generation depend on earlier examples).
    """
    target = get(obj, path)
    number = isinstance(target, (int, float)) and not isinstance(target, bool)
    if kind == "swap":
        return set_at(obj, path, type_swap(target, arg))
    if kind == "odd":
        return set_at(obj, path, copy.deepcopy(arg))
    if kind == "delete" and path:
        del get(obj, path[:-1])[path[-1]]
    elif kind == "extra" and isinstance(target, dict):
        key, value = arg
        target[key] = copy.deepcopy(value)
    elif kind == "scale" and number:
        return set_at(obj, path, scaled(target, arg))
    elif kind == "negate" and number:
        return set_at(obj, path, -target if target else -1)
    elif kind == "nest":
        return set_at(obj, path, [[[[target]]]])
    return obj


def encode(obj) -> bytes:
    return json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass")


@st.composite
def mutated_json(draw):
    name = draw(st.sampled_from(sorted(PARSED)))
    obj = json.loads(json.dumps(PARSED[name]))  # a deep copy
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(list(paths(obj))))
        kind = draw(st.sampled_from(list(MUTATIONS)))
        obj = mutate(obj, path, kind, draw(MUTATIONS[kind]))
    return encode(obj)


@FUZZ
@given(raw=mutated_json())
def test_structural_mutations_have_only_the_three_outcomes(raw, tmp_path, capsys):
    check(raw, tmp_path, capsys)


def test_huge_integer_scaled_by_a_float_is_built_and_malformed(tmp_path, capsys):
    """The input that crashed the mutation code: Sizes[3] = 10**400, scaled by 2**70, then by 1e300."""
    obj = json.loads(json.dumps(PARSED["valid-minimal.json"]))
    path = ("InputParametersTensor", "Sizes", 3)
    for kind, arg in [("odd", 10**400), ("scale", 2**70), ("scale", 1e300)]:
        obj = mutate(obj, path, kind, arg)
    assert get(obj, path) == round(Fraction(10**400 * 2**70) * Fraction(1e300))
    assert check(encode(obj), tmp_path, capsys) == 2  # a size above UINT32


def test_mutations_never_change_the_drawn_values():
    odd = {"Sizes": [1]}
    obj = json.loads(json.dumps(PARSED["valid-minimal.json"]))
    obj = mutate(obj, ("InputParametersTensor",), "odd", odd)
    obj = mutate(obj, ("InputParametersTensor", "Sizes", 0), "scale", 3)
    obj = mutate(obj, ("GradientTensor",), "extra", ("Sizes", odd))
    obj = mutate(obj, ("GradientTensor", "Sizes", "Sizes", 0), "negate", None)
    assert obj["InputParametersTensor"] == {"Sizes": [3]} and obj["GradientTensor"]["Sizes"] == {"Sizes": [-1]}
    assert odd == {"Sizes": [1]}


@st.composite
def byte_flipped(draw):
    name = draw(st.sampled_from(sorted(TEXTS)))
    raw = bytearray(TEXTS[name])
    for _ in range(draw(st.integers(1, 8))):
        i = draw(st.integers(0, len(raw) - 1))
        op = draw(st.sampled_from(["set", "xor", "delete", "insert"]))
        b = draw(st.integers(0, 255))
        if op == "set":
            raw[i] = b
        elif op == "xor":
            raw[i] ^= 1 << (b % 8)
        elif op == "delete":
            del raw[i]
        else:
            raw.insert(i, b)
    return bytes(raw)


@FUZZ
@given(raw=byte_flipped())
def test_byte_flips_have_only_the_three_outcomes(raw, tmp_path, capsys):
    check(raw, tmp_path, capsys)


@st.composite
def literal_edits(draw):
    """Text-level edits JSON serialisers never write: NaN/Infinity, huge literals, deep nesting."""
    name = draw(st.sampled_from(sorted(PARSED)))
    text = TEXTS[name].decode()
    needle = draw(st.sampled_from(['0.001', '0.9', '0.999', '1e-08', '4096', '4', ' 1,', '[1, 1, 1, ', 'null', '"NONE"']))
    repl = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-0", "1" * 5000, "9" * 400 + ".5",
                                 "[" * 5000 + "]" * 5000, "1E400", "0x10", "+1", ".5", "01"]))
    return text.replace(needle, repl, draw(st.integers(1, 3))).encode()


@FUZZ
@given(raw=literal_edits())
def test_literal_edits_have_only_the_three_outcomes(raw, tmp_path, capsys):
    check(raw, tmp_path, capsys)


@pytest.mark.parametrize("raw", [b"", b"\xff\xfe\x00", b"[]", b"null", b"1", b"\"x\"", b"{}", b"[" * 100000,
                                 "{\"operator\": \"ADAM_OPTIMIZER\", \"LearningRate\": NaN}".encode()],
                         ids=["empty", "bad-utf8", "list", "null", "number", "string", "empty-object", "deep", "nan"])
def test_degenerate_inputs_are_malformed(raw, tmp_path, capsys):
    assert check(raw, tmp_path, capsys) == 2


def test_unmutated_corpus_matches_its_expectations(tmp_path, capsys):
    """The fuzzers' starting points: each file's own ``expect.exit`` (when readable)."""
    for name, obj in PARSED.items():
        expected = obj.get("expect", {}).get("exit") if isinstance(obj, dict) else None
        got = check(TEXTS[name], tmp_path, capsys)
        if expected is not None:
            assert got == expected, name
