import pytest

from preflight import format_bytes, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), ("512 MiB", 512 * 2**20), ("1.5gib", 3 * 2**29),
     (1 << 30, 1 << 30), ("100B", 100), ("2TB", 2 * 10**12), ("0", 0)],
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


@pytest.mark.parametrize("value, message", [
    (float("nan"), "`budget`: A size should be a finite number of bytes, got nan"),
    (float("inf"), "`budget`: A size should be a finite number of bytes, got inf"),
    pytest.param(10**400, r"`budget`: 10000000000000000000\.\.\.00000000 \(401 characters\) is more than any memory",
                 id="400-digits"),
    pytest.param("1" + "0" * 400 + "GiB", r"`budget`: '1000.*\(406 characters\) is more than any memory",
                 id="400-digits-GiB"),
    (-1, "`budget`: A size cannot be negative, got -1"),
])
def test_an_unusable_size_names_the_argument_and_the_value(value, message):
    with pytest.raises(ValueError, match=message):
        parse_bytes(value, name="budget")


def test_numpy_numbers_are_sizes():
    np = pytest.importorskip("numpy")
    assert parse_bytes(np.int64(2**30)) == 2**30
    assert parse_bytes(np.float32(1024.0)) == 1024
    assert parse_bytes(2**64) == 2**64  # the largest accepted: a 64-bit address space


@pytest.mark.parametrize("text", ["80", "80.5", " 24 "])
def test_a_string_without_a_unit_is_refused_with_the_units_meant(text):
    # Issue 24, item 10: "80" silently meant 80 bytes (and ten suggestions traced for an 80-byte budget).
    digits = text.strip()
    with pytest.raises(ValueError, match=rf"'{text}' has no unit\. Did you mean {digits}GB or {digits}GiB\?"):
        parse_bytes(text, name="budget")
    assert parse_bytes(int(float(digits))) == int(float(digits))  # an int is a number of bytes, as documented
