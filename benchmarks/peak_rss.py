"""`python peak_rss.py MODULE ARGS...`: run MODULE as `python -m MODULE ARGS...` would, then print
"RSS <kilobytes>", this process's peak resident memory (for each of torchrun's workers)."""
import atexit
import resource
import runpy
import sys

atexit.register(lambda: print("RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True))
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
