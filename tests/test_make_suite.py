"""make test's two pytest runs split the suite between them: the serial run collects only the Makefile's
SERIAL_TESTS, so those files must be exactly the modules conftest marks serial, or a serial case would run
in neither (a module marked but not listed) or a listed one would run with nothing to select."""

from __future__ import annotations

import re

from conftest import SERIAL_MODULES
from venv_lock import ROOT


def test_the_serial_run_collects_every_serial_module_and_no_other():
    makefile = (ROOT / "Makefile").read_text()
    (listed,) = re.findall(r"^SERIAL_TESTS := (.*)$", makefile, re.M)
    assert {f"tests/{m}.py" for m in SERIAL_MODULES} == set(listed.split())
    assert all((ROOT / path).is_file() for path in listed.split())
