"""Multi-stage jobs that combine the layers below (data, decoding, train, eval) and that the command line and
the demo run: `shipped.py` rebuilds the drafters shipped with the embedded target (`make drafters`)."""
