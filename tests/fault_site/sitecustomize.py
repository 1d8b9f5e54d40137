"""Run first by every Python process whose path holds this folder: the servers the
reliability tests start, and every process those start (engine processes, Ray's).
With ``CARPOOL_TEST_FAULTS`` set, once the process imports carpool's bootstrap, the
models it loads fail as that plan says (``tests/faults.py``); a process that never
imports it (Ray's own helpers) is left as it is."""

import os

if "CARPOOL_TEST_FAULTS" in os.environ:
    from tests.fault_site.after_import import after_import

    def _install() -> None:
        from tests.faults import install

        install(os.environ["CARPOOL_TEST_FAULTS"])

    after_import("carpool.server.bootstrap", _install)
