"""Imported first by the CPU fork server (``launcher._FORKSERVER_PRELOAD``), for its side effect only:
what the imports after it log or warn is held for the ranks' logs (``rank_logs.hold_import_records``)."""

from megatron_tlt import rank_logs

rank_logs.hold_import_records()
