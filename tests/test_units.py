import pytest

from preflight import format_bytes, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), ("512 MiB", 512 * 2**20), ("1.5gib", 3 * 2**29),
     (1 << 30, 1 << 30), ("100", 100), ("2TB", 2 * 10**12)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["12 GB?", "lots", "-3GB", -1, True, "3 XB"])
def test_parse_bytes_rejects_with_the_accepted_forms(bad):
    with pytest.raises(ValueError, match="size|negative|bytes"):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(12) == "12 B"
    assert format_bytes(None) == "unknown"
