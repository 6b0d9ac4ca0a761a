"""pytest with the FP8 copies' recompute pass logging at DEBUG to stdout: which FP8 copy each compiled graph keeps
for backward, and why (the op on its way back that is neither cheap nor kept by the backward).

    python3 scripts/gpu/diag_recompute.py -m gpu tests/gpu/test_fp8_copies_recompute_gpu.py

Only that logger: pytest's --log-cli-level=DEBUG would print torch's trace logs too (thousands of lines)."""

import logging
import sys

import pytest

logger = logging.getLogger("lowprec.runtime.fp8_copies_recompute")
logger.setLevel(logging.DEBUG)
logger.addHandler(logging.StreamHandler(sys.stdout))
logger.propagate = False
sys.exit(pytest.main(["-s", "-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
