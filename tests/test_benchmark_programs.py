"""benchmarks/programs.py's choices: XLA's defaults, or sdx's options with `--option NAME=VALUE` changes;
a change without a value is refused before anything is built."""

import pytest

from benchmarks import programs
from pipelines import cpu_kernels


def test_the_default_choice_is_no_options_or_sdxs_with_the_changes():
    assert programs.default_options([]) == {}
    changed = programs.default_options([f"{cpu_kernels.YNNPACK_FUSIONS}=LIBRARY_FUSION_TYPE_REDUCE", "xla_cpu_x=a=b"])
    assert changed == {**cpu_kernels.OPTIONS, cpu_kernels.YNNPACK_FUSIONS: "LIBRARY_FUSION_TYPE_REDUCE", "xla_cpu_x": "a=b"}
    assert changed[cpu_kernels.SCHEDULER] == cpu_kernels.OPTIONS[cpu_kernels.SCHEDULER]


def test_an_option_without_a_value_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        programs.parse(["--option", "xla_cpu_experimental_ynn_fusion_type"])
    assert exit_.value.code == 2
    assert "--option takes NAME=VALUE" in capsys.readouterr().err
    assert programs.parse(["--option", "a=", "--option", "b=c"]).option == ["a=", "b=c"]
