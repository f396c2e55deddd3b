"""Benchmarks: lmcli against a peer, side by side in the same process, reported as ratios."""
