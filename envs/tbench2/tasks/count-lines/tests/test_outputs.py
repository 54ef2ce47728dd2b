"""/app/line_count.txt must hold the line count of the (unchanged) access log."""

import hashlib
from pathlib import Path

LOG = Path("/app/data/access.log")
ANSWER = Path("/app/line_count.txt")
LOG_SHA256 = "3ab7b601b3498ace700dd15d6adc22e66258fbfc6d861e17f23ca8f0ce01147b"


def test_log_unchanged():
    assert hashlib.sha256(LOG.read_bytes()).hexdigest() == LOG_SHA256


def test_answer_is_the_line_count():
    assert ANSWER.is_file(), f"{ANSWER} does not exist"
    assert ANSWER.read_text().strip() == "137"
