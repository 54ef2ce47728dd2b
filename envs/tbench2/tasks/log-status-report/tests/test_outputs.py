"""The status report and slow-path list must match the request log exactly."""

from pathlib import Path

REPORT = Path("/app/report.txt")
SLOW = Path("/app/slow_paths.txt")
EXPECTED_REPORT = [
    "200 125",
    "201 25",
    "304 23",
    "401 18",
    "404 18",
    "503 16",
    "500 10",
    "400 6",
]
EXPECTED_SLOW = [
    "/api/orders",
    "/api/orders/export",
    "/api/reports/daily",
    "/api/search",
    "/api/users",
]


def _lines(path: Path) -> list[str]:
    assert path.is_file(), f"{path} does not exist"
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def test_status_report():
    assert _lines(REPORT) == EXPECTED_REPORT


def test_slow_paths():
    assert _lines(SLOW) == EXPECTED_SLOW
