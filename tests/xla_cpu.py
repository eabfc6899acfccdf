"""UNOPTIMIZED: the XLA:CPU flags of a program compiled to run a few times (the pytest process' own programs,
conftest.py; a test's one-off main.py runs, run_util.unoptimized): XLA at -O0, and XLA:CPU's elemental fusion
emitters instead of its MLIR ones (--xla_cpu_use_fusion_emitters=false). Each compiles the small models'
programs faster and runs them slower. The tiny preset's train step on one device, compiled cold beside other
work (load 3.5): 25 s at -O2 (either emitters), 11.3 s at -O0, 3.6 s at -O0 with the elemental emitters, the
same losses; 40 steps of it train in 20 s at -O0, 21-23 s at -O0 with the elemental emitters, 9 s at -O2.
No jax here: conftest.py reads this before jax is imported."""
UNOPTIMIZED = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
