import numpy as np
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


@pytest.mark.parametrize(
    "text, expected",
    [("1e9", 10**9), ("2.5e9", 2_500_000_000), ("1e9B", 10**9), ("1E3 KiB", 1000 << 10),
     ("0.5GiB", 1 << 29), ("4.35GB", 4_350_000_000), ("1_000_000", 1_000_000), ("2e-3GB", 2_000_000)],
)
def test_parse_size_reads_scientific_notation_and_grouped_digits_exactly(text, expected):
    assert parse_size(text) == expected


def test_parse_size_takes_numpy_integers_as_bytes():
    assert parse_size(np.int64(4096)) == 4096


@pytest.mark.parametrize("bad", ["-1e9", "-0.5GiB", -1])
def test_parse_size_names_a_negative_size(bad):
    with pytest.raises(BudgetError, match=f"negative, got {bad!r}"):
        parse_size(bad)


@pytest.mark.parametrize("bad", ["nan", "inf", "NaN GB", "-inf", float("nan"), float("inf")])
def test_parse_size_refuses_nan_and_infinity(bad):
    with pytest.raises(BudgetError, match="cannot read memory size"):
        parse_size(bad)


@pytest.mark.parametrize("bad", ["1e19", "9223372036854775808", "9e6TiB", "1e999999999", 2**63])
def test_parse_size_refuses_sizes_of_2_to_the_63_bytes_or_more(bad):
    with pytest.raises(BudgetError, match="absurdly large"):
        parse_size(bad)


def test_parse_size_accepts_the_largest_size_below_2_to_the_63():
    assert parse_size(str(2**63 - 1)) == 2**63 - 1


@pytest.mark.parametrize("bad", ["1__000", "_1000", "1000_", "1_.5", "1e", "1e9e9"])
def test_parse_size_refuses_misplaced_underscores_and_exponents(bad):
    with pytest.raises(BudgetError, match="cannot read memory size"):
        parse_size(bad)
