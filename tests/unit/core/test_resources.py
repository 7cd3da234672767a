import numpy as np
import pytest

from services.core.constraints import (
    ConstraintError,
    describe_constraints,
    from_mask,
    parse_constraints,
    to_mask,
)
from services.core.resources import (
    ResourceError,
    format_resources,
    parse_resources,
    resources,
    validate_capacity,
    validate_request,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cpu=500m,mem=2Gi", resources(500, 2048)),
        ("cpu=2, memory=512Mi", resources(2000, 512)),
        ("cpu=0.5,mem=1G,disk=10Gi,net=100M", resources(500, 954, 10240, 100)),
        ("cpu=1,net=1G", resources(1000, 0, 0, 1000)),
        ("mem=300", resources(0, 300)),
        ("cpu=1.0001", resources(1001, 0)),  # rounds up, never under-asks
    ],
)
def test_parse_resources_reads_human_quantities(text, expected):
    np.testing.assert_array_equal(parse_resources(text), expected)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no resources given"),
        ("cpu", "expected name=quantity"),
        ("gpu=1", "unknown resource 'gpu'"),
        ("cpu=1,cpu=2", "given twice"),
        ("cpu=abc", "cannot read cpu quantity"),
        ("cpu=2x", "unknown cpu unit"),
        ("mem=2Qi", "unknown memory unit"),
        ("cpu=0", "asks for nothing"),
        ("mem=999999999Ti", "out of range"),
    ],
)
def test_parse_resources_explains_bad_input(text, message):
    with pytest.raises(ResourceError, match=message):
        parse_resources(text)


def test_validation_rejects_negative_and_empty():
    with pytest.raises(ResourceError, match="negative quantity: memory_mb=-1"):
        validate_request(resources(100, -1))
    with pytest.raises(ResourceError, match="cpu_milli > 0 and memory_mb > 0"):
        validate_capacity(resources(1000, 0))
    with pytest.raises(ResourceError, match="must have 4 quantities"):
        validate_request(np.array([1, 2], dtype=np.int64))


def test_format_resources_is_readable():
    assert format_resources(resources(1500, 2048)) == "cpu=1500m mem=2048Mi disk=0Mi net=0M"
    assert format_resources(resources(2000, 1)) == "cpu=2 mem=1Mi disk=0Mi net=0M"


def test_constraint_masks_round_trip_and_reject_unknown_ids():
    assert from_mask(to_mask([0, 7, 20, 63])) == [0, 7, 20, 63]
    assert parse_constraints(" 3, 7 ,,12", 21) == (1 << 3) | (1 << 7) | (1 << 12)
    assert parse_constraints("", 21) == 0
    known = r"unknown constraint 21; this federation knows 0\.\.20"
    with pytest.raises(ConstraintError, match=known):
        to_mask([21], 21)
    with pytest.raises(ConstraintError, match="integers"):
        parse_constraints("a", 21)


def test_constraints_by_the_names_a_federation_gives_them():
    names = {"ssd": 3, "gpu": 7}
    assert parse_constraints("ssd, gpu,12", 21, names) == (1 << 3) | (1 << 7) | (1 << 12)
    with pytest.raises(
        ConstraintError, match="unknown constraint 'tpu'; this federation names gpu, ssd"
    ):
        parse_constraints("ssd,tpu", 21, names)
    with pytest.raises(ConstraintError, match=r"got 'ssd' \(this federation names no constraints"):
        parse_constraints("ssd", 21)
    assert describe_constraints([3, 7, 12], {3: "ssd", 7: "gpu"}) == "3 (ssd), 7 (gpu), 12"
