"""Side-by-side benchmarks against the tools users would otherwise use (`make bench`)."""

import os
import sys

# A benchmark (`python -m bench.NAME`) measures ranks and stages started as a user's are: never forked from the test
# session's servers (pipeline/launching/rank_server.py, pipeline/core/stage_server.py), whose imports and memory its
# figures would leave out.
if sys.orig_argv[1:2] == ["-m"] and sys.orig_argv[2:3] and sys.orig_argv[2].startswith("bench."):
    os.environ.pop("TRAIN_RANK_SERVERS", None)
    os.environ.pop("PIPELINE_STAGE_SERVERS", None)
