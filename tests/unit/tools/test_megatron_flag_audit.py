"""tools/megatron_flag_audit.py --arguments: Megatron-LM's parser flags are read from a
checkout (importing it with stand-ins for modules this machine lacks) and sorted into
accepted, clear errors and missing."""
import os
import sys
import textwrap

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools"))
import megatron_flag_audit  # noqa: E402


def test_parser_flags_of_a_checkout_with_missing_dependencies(tmp_path):
    """A stand-in Megatron-LM whose arguments module imports a package that is not installed
    and adds a flag from a dataclass, as Megatron-LM main does."""
    training = tmp_path / "megatron" / "training"
    training.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (training / "__init__.py").write_text("")
    (training / "arguments.py").write_text(textwrap.dedent('''
        import dataclasses
        import transformer_engine_not_installed as te
        from transformer_engine_not_installed.pytorch import fp8_autocast

        @dataclasses.dataclass
        class Config:
            init_model_with_meta_device: bool = False

        @te.jit
        def kernel():
            return 1

        def add_megatron_arguments(parser):
            parser.add_argument("--num-layers", type=int)
            parser.add_argument("--fp8-format", choices=["e4m3", "hybrid"])
            parser.add_argument("--not-a-flag-here", action="store_true")
            parser.add_argument("--rampup-batch-size", nargs=3, type=int)
            for field in dataclasses.fields(Config):
                parser.add_argument("--" + field.name.replace("_", "-"), action="store_true")
            return parser
    '''))
    specs = megatron_flag_audit.megatron_parser_flags(str(training / "arguments.py"))
    assert [spec["flag"] for spec in specs] == [
        "--num-layers", "--fp8-format", "--not-a-flag-here", "--rampup-batch-size",
        "--init-model-with-meta-device"]
    assert megatron_flag_audit._sample_argv(specs[3]) == ["--rampup-batch-size", "1", "1", "1"]
    result = megatron_flag_audit.audit_parser(specs)
    assert result["flags"] == 5
    assert result["accepted"] == ["--init-model-with-meta-device", "--num-layers",
                                  "--rampup-batch-size"]
    assert list(result["error"]) == ["--fp8-format"]  # a ConfigError naming it
    assert result["missing"] == ["--not-a-flag-here"]
