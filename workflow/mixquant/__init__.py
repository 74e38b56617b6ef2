"""mixquant: reproducible mixed-precision quantization of MoE LLMs (library; imports Snakemake's code only to
read Snakemake's own command-line arguments, such as --config, the way a run reads them)."""

import warnings

# ModelOpt warns on import, once in every job's process, that transformers is newer than the one it was
# tested with. The pair is pinned (pyproject.toml, envs/) and recorded in every manifest, and the export is
# checked against ModelOpt's own (tests/): said by every job, the warning would only bury the run's lines.
warnings.filterwarnings("ignore", message=r"transformers \S+ is not tested with current version of modelopt")

__version__ = "0.1.0"
