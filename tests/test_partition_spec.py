"""P: JAX's PartitionSpec semantics, normalization and validation errors naming the leaf."""

from __future__ import annotations

import pytest

from funcshard import Mesh, P, SpecError

MESH = Mesh({"dp": 2, "fsdp": 4})


def test_trailing_none_and_one_axis_tuples_are_equivalent():
    assert P("fsdp") == P("fsdp", None) == P(("fsdp",)) == P(["fsdp"])
    assert hash(P("fsdp")) == hash(P("fsdp", None, None))
    assert P(()) == P(None) == P()
    assert P("fsdp") != P(None, "fsdp")
    assert P(("dp", "fsdp")) != P(("fsdp", "dp"))


def test_entries_axes_and_dims():
    spec = P(None, ("dp", "fsdp"), "tp")
    assert spec.entries == (None, ("dp", "fsdp"), "tp")
    assert spec.axes == ("dp", "fsdp", "tp")
    assert spec.dims(4) == ((), ("dp", "fsdp"), ("tp",), ())
    assert list(spec) == [None, ("dp", "fsdp"), "tp"]
    assert spec[1] == ("dp", "fsdp")
    assert repr(spec) == "P(None, ('dp', 'fsdp'), 'tp')"
    assert P.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("entry", [1, 1.5, ("a", 2), {"a"}])
def test_bad_entry_type(entry):
    with pytest.raises(TypeError, match="must be None, a mesh axis name or a tuple of axis names"):
        P(entry)


@pytest.mark.parametrize(
    ("spec", "ndim", "kind", "message"),
    [
        (
            P("tp"),
            2,
            "unknown_axis",
            r"blocks/0/w: P\('tp'\) names mesh axis 'tp', which is not in the mesh \(axes \['dp', 'fsdp'\]\); use one of those axes or None",
        ),
        (
            P("fsdp", "fsdp"),
            2,
            "duplicate_axis",
            r"blocks/0/w: P\('fsdp', 'fsdp'\) uses mesh axis 'fsdp' twice; each mesh axis may shard at most one dim",
        ),
        (P(("dp", "fsdp"), "dp"), 2, "duplicate_axis", "uses mesh axis 'dp' twice"),
        (P(("fsdp", "fsdp")), 1, "duplicate_axis", "uses mesh axis 'fsdp' twice"),
        (
            P("dp", None, None),
            2,
            "too_many_entries",
            r"has 3 entries but the leaf has 2 dims; give at most one entry per dim",
        ),
        (P(None), 0, "too_many_entries", "has 1 entry but the leaf has 0 dims"),
    ],
)
def test_invalid_specs_name_the_leaf_and_the_fix(spec, ndim, kind, message):
    with pytest.raises(SpecError, match=message) as info:
        spec.validate(MESH, ndim, path="blocks/0/w")
    assert info.value.kind == kind
    assert isinstance(info.value, ValueError)


def test_valid_specs_pass():
    for spec, ndim in [(P(), 0), (P("dp"), 1), (P(None, ("fsdp", "dp")), 2), (P("fsdp", None), 2)]:
        spec.validate(MESH, ndim)
