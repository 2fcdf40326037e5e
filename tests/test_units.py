import pytest

from tierflow import BudgetError, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [("512MB", 512_000_000), ("4GiB", 4 << 30), ("1.5G", 1_500_000_000), ("100", 100),
     (" 2 kib ", 2048), ("0", 0), (123, 123)],
)
def test_parse_size_reads_decimal_and_binary_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "4 XB", "-1GB", "", "GB", -5, True, 1.5, None])
def test_parse_size_rejects_what_is_not_a_size(bad):
    with pytest.raises(BudgetError, match="size"):
        parse_size(bad)
