"""What the tests share, so that no test module imports another: fixture roots (`roots`), the
real edged process (`daemon_harness`), a real Mosquitto (`broker`), a Debian-like image root
(`images`), a board with thermal zones (`thermal_roots`), the systemd units and the fake
systemctl (`systemctl`), the payload schemas (`schema`). The markers and fixtures every test
sees are in tests/conftest.py."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
