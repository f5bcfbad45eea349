"""Small helpers for calendar dates written as "YYYY-MM-DD" strings or (year, month, day)."""

MONTH_NAMES = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]


def is_leap_year(year: int) -> bool:
    """Return True if year is a leap year: divisible by 4, except centuries not divisible by 400."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year: int, month: int) -> int:
    """Return the number of days in month (1-12) of year; February has 29 in a leap year."""
    if month == 2:
        return 29 if is_leap_year(year) else 28
    return 30 if month in (4, 6, 9, 11) else 31


def parse_date(text: str) -> tuple[int, int, int]:
    """Return (year, month, day) from a "YYYY-MM-DD" string; ValueError without three parts."""
    parts = text.split("-")
    if len(parts) != 3:
        raise ValueError(f"not a YYYY-MM-DD date: {text!r}")
    year, month, day = (int(part) for part in parts)
    return year, month, day


def format_date(year: int, month: int, day: int) -> str:
    """Return the date as a zero-padded "YYYY-MM-DD" string, e.g. (2024, 3, 7) -> "2024-03-07"."""
    return f"{year:04d}-{month:02d}-{day:02d}"


def is_valid_date(text: str) -> bool:
    """Return True if text is a 10-character "YYYY-MM-DD" string naming a real calendar day."""
    try:
        year, month, day = parse_date(text)
    except ValueError:
        return False
    return len(text) == 10 and 1 <= month <= 12 and 1 <= day <= days_in_month(year, month)


def day_of_year(year: int, month: int, day: int) -> int:
    """Return the 1-based day number within the year: 1 for Jan 1, 365 or 366 for Dec 31."""
    return sum(days_in_month(year, m) for m in range(1, month)) + day


def month_name(month: int) -> str:
    """Return the English name of month 1-12, e.g. 3 -> "March"; ValueError for any other number."""
    if not 1 <= month <= 12:
        raise ValueError(f"no such month: {month}")
    return MONTH_NAMES[month - 1]


def compare_dates(a: str, b: str) -> int:
    """Return -1 if the "YYYY-MM-DD" date a is earlier than b, 1 if it is later, 0 if equal."""
    return (a > b) - (a < b)


def next_day(year: int, month: int, day: int) -> tuple[int, int, int]:
    """Return the (year, month, day) that follows the given date, rolling over months and years."""
    if day < days_in_month(year, month):
        return year, month, day + 1
    if month < 12:
        return year, month + 1, 1
    return year + 1, 1, 1
