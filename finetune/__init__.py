"""Fine-tuning on GLUE and SQuAD: `python -m finetune task=<name> model_path=<HF folder>`.

Tasks and their data live in `finetune.tasks` (registry `TASKS`), metrics in `finetune.metrics`.
"""
