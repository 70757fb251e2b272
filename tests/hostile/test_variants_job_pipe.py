"""The variants job's child as a runtime may make it behave: more than a pipe's worth on
stdout before it says anything on stderr (the job read stderr to its end first, and both
processes waited on each other for ever), and one endless line on stderr. A real child
process each time (a small Python program standing in for `edged.quantize.variants`)."""

from __future__ import annotations

import sys

import pytest

from edged.serving.variant_job import LINE_BYTES, VariantJob

# Writes `out` bytes of noise to stdout, then `err` bytes to stderr with no newline, a progress
# line, and the JSON report as stdout's last line; exits with `code`.
CHILD = r"""
import json, sys
out, err, code = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
chunk = b"noise " * 1000 + b"\n"
written = 0
while written < out:
    sys.stdout.buffer.write(chunk)
    written += len(chunk)
sys.stdout.flush()
sys.stderr.write("e" * err)
sys.stderr.write("\nprogress 2/3 variants\n")
sys.stderr.flush()
print(json.dumps({"ok": code == 0, "made": {"variants": ["a.onnx"]}, "pick": "a.onnx"}))
sys.exit(code)
"""


def job(out: int, err: int = 0, code: int = 0) -> tuple[VariantJob, list[dict]]:
    reports: list[dict] = []
    command = [sys.executable, "-c", CHILD, str(out), str(err), str(code)]
    return VariantJob("m", command, lambda report: reports.append(report) or "swapped"), reports


@pytest.mark.timing
def test_a_child_writing_megabytes_to_stdout_finishes() -> None:
    """4 MiB on stdout before a word on stderr: the job finishes and finds the report."""
    variants, reports = job(out=4 * 2**20)
    variants.start()
    assert variants.wait(60), "the job and its child waited on each other"
    assert variants.state == "done", variants.error
    assert variants.result == "swapped" and reports[0]["pick"] == "a.onnx"
    assert variants.status()["progress"] == "2/3 variants"


@pytest.mark.timing
def test_an_endless_stderr_line_is_read_in_bounded_pieces() -> None:
    """8 MiB on stderr without a newline, then a failure: the error the status shows is a
    bounded tail of it, not all of it."""
    variants, reports = job(out=0, err=8 * 2**20, code=3)
    variants.start()
    assert variants.wait(60)
    assert variants.state == "failed" and not reports
    assert variants.error is not None and len(variants.error) < 3 * LINE_BYTES
