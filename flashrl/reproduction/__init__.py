"""Reproduction: the method's reference release, its five experiments as data and their translations.

The release (`yifanzhang-pro/FlashREINFORCE`) names five experiments (`r1`, `qwen_math`,
`qwen7b_tool`, `qwen3_tool_ablation`, `alfworld`), each with named variants, as files of flags for
its GPU runtime, NVIDIA Molt 0.2.1. This package holds them and turns them into runs:

* `flashrl.reproduction.experiments`: the experiments and their variants as data (each value names
  the release's file it comes from); `resolve_experiment(name, variants)`.
* `flashrl.reproduction.translate`: the release's flags -> `FlashReinforceConfig` fields, each with
  its source.
* `flashrl.reproduction.experiment_run`: `run_experiment(name)`, the main of a GPU tuned example
  (`--variant`, `--print-config`), built on `flashrl.recipes` (the tuned examples' command line and
  the `--dry-run` planner).
* `flashrl.reproduction.molt`: the same experiments as a command line of Molt 0.2.1
  (`scripts/train_molt.py`); `molt_rl_0_2_1_flags` records that version's flags.

The data modules (`experiments`, `translate`, `molt`) need only the standard library at import, so
`scripts/train_molt.py` runs on a bare Python. Nothing outside this package and the entry points
(tuned examples, scripts, benchmarks) imports it.
"""
