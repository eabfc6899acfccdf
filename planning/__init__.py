"""Will it fit? The memory plan of a run and of a TPU slice or GPU it may be rented on, in rooms by audience:

  fit.py        the run's fit check (main.py, bench.py): the plan from shapes before anything is allocated,
                --fit's choice on the run's devices, a step too large said in one line naming what fits
  tradeoffs.py  the settings that trade compute for memory, and the cheapest that fits (pure config logic)
  measure.py    compile a config and measure it: a target's devices and mesh, the compile or the compiler's
                refusal, the plan and FLOPs of a compiled step (hardware.py is the catalogue of targets)
  report.py     the `--compile_for` report (main.py, for --compile_for alone)
  step_time.py  the H200 step-time estimate the report prints, calibrated on timed steps

The training run imports fit.py and measure.py (and through them tradeoffs.py), never report.py or
step_time.py (tests/test_layout.py).
"""
