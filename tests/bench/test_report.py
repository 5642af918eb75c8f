"""The machine record every bench result carries."""
from specdec.bench.report import _cpu_name


def test_cpu_name_carries_family_and_model_of_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n\n"
                    "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: Other\n")
    assert _cpu_name(str(info)) == "AMD EPYC (family 25 model 17)"


def test_cpu_name_without_family_is_the_model_name(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\n")
    assert _cpu_name(str(info)) == "Some CPU"
