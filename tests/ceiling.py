"""How long a test waits for a subprocess (main.py, a launch script, a compile) before it calls it hung.

A backstop, never a speed target: CI's machine runs loaded (a 400 s limit on one main.py --sample failed
at a load of 14), so tests wait on events (a line, a record, an exit) and this only bounds a hang."""
CEILING_S = 1800
