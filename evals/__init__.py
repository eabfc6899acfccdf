"""How good is the model, beyond its loss: downstream tasks scored on the training mesh, in the loop and on
any checkpoint after the fact (--evaluate).

  tasks.py    what a task is (`Task`, the interface scoring reads), the bundled kjv_endings and the olmo_*
              multiple-choice tasks
  harness.py  lm-evaluation-harness's tasks by name or YAML file, scored by the harness's own code
  scoring.py  the tasks' requests as rows on the mesh (trainer.score_step), their scores and records
  restored.py a checkpoint read after the fact: --evaluate's scores of it, and what --sample reads
"""
