import pytest
from smallkit.dates import (
    compare_dates,
    day_of_year,
    days_in_month,
    format_date,
    is_leap_year,
    is_valid_date,
    month_name,
    next_day,
    parse_date,
)


@pytest.mark.parametrize("year", [2024, 2000, 1996])
def test_is_leap_year_true(year):
    assert is_leap_year(year) is True


@pytest.mark.parametrize("year", [2023, 1900, 2100])
def test_is_leap_year_false(year):
    assert is_leap_year(year) is False


@pytest.mark.parametrize(("month", "expected"), [(1, 31), (4, 30), (9, 30), (12, 31)])
def test_days_in_month(month, expected):
    assert days_in_month(2023, month) == expected


def test_days_in_month_february():
    assert days_in_month(2023, 2) == 28
    assert days_in_month(2024, 2) == 29
    assert days_in_month(1900, 2) == 28


def test_parse_date():
    assert parse_date("2024-03-07") == (2024, 3, 7)
    assert parse_date("1999-12-31") == (1999, 12, 31)


def test_parse_date_bad_input_raises():
    with pytest.raises(ValueError):
        parse_date("2024/03/07")
    with pytest.raises(ValueError):
        parse_date("2024-03")


def test_format_date_pads_with_zeros():
    assert format_date(2024, 3, 7) == "2024-03-07"
    assert format_date(987, 1, 1) == "0987-01-01"


def test_format_date_two_digit_parts():
    assert format_date(1999, 12, 31) == "1999-12-31"


@pytest.mark.parametrize("text", ["2024-02-29", "2023-12-31", "2000-01-01"])
def test_is_valid_date_true(text):
    assert is_valid_date(text) is True


@pytest.mark.parametrize(
    "text", ["2023-02-29", "2024-13-01", "2024-04-31", "2024-00-10", "2024-1-5", "hello", ""]
)
def test_is_valid_date_false(text):
    assert is_valid_date(text) is False


def test_day_of_year():
    assert day_of_year(2023, 1, 1) == 1
    assert day_of_year(2023, 3, 1) == 60


def test_day_of_year_leap_year():
    assert day_of_year(2024, 3, 1) == 61
    assert day_of_year(2024, 12, 31) == 366
    assert day_of_year(2023, 12, 31) == 365


def test_month_name():
    assert month_name(1) == "January"
    assert month_name(3) == "March"
    assert month_name(12) == "December"


@pytest.mark.parametrize("month", [0, 13, -1])
def test_month_name_out_of_range_raises(month):
    with pytest.raises(ValueError):
        month_name(month)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("2024-01-01", "2024-01-02", -1),
        ("2024-10-01", "2024-09-30", 1),
        ("2023-12-31", "2023-12-31", 0),
        ("1999-12-31", "2000-01-01", -1),
    ],
)
def test_compare_dates(a, b, expected):
    assert compare_dates(a, b) == expected


def test_next_day_within_month():
    assert next_day(2024, 3, 7) == (2024, 3, 8)


def test_next_day_rolls_over():
    assert next_day(2023, 2, 28) == (2023, 3, 1)
    assert next_day(2024, 2, 28) == (2024, 2, 29)
    assert next_day(2023, 12, 31) == (2024, 1, 1)
