"""Side-by-side benchmarks against the tools users would otherwise use (`make bench`)."""

import os
import sys

# A benchmark (`python -m bench.NAME`) measures ranks started as a user's are: never forked from the test session's
# rank servers (pipeline/launching/rank_server.py), whose imports and memory its figures would leave out.
if sys.orig_argv[1:2] == ["-m"] and sys.orig_argv[2:3] and sys.orig_argv[2].startswith("bench."):
    os.environ.pop("TRAIN_RANK_SERVERS", None)
