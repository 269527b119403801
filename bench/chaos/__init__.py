"""A seeded chaos run: faults drawn from a seed on a 3-node cluster, the invariants checked
while it runs and at the end (``python -m bench.chaos --minutes M --seed S``; bench/README.md).

- :mod:`bench.chaos.schedule`: the faults, drawn whole from the seed;
- :mod:`bench.chaos.invariants`: the checks, plain functions of what was observed;
- :mod:`bench.chaos.observe`: what is watched while the run goes on;
- :mod:`bench.chaos.faults`: carrying a fault out and putting things back;
- :mod:`bench.chaos.run`: the stage, the schedule, the drain, the verdict;
- :mod:`bench.chaos.report`: what is printed and written.
"""
