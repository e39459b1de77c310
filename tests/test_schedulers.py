"""Scheduler config parsing, refusals, the noise schedule, img2img cuts and the training targets.
(Trajectory parity with diffusers is in test_schedulers_parity.py.)"""

from __future__ import annotations

import dataclasses
import inspect

import diffusers
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.training_utils import compute_snr

from sdx import schedulers
from sdx.errors import SdxError
from sdx.schedulers import DDPM, Euler, names, training

# sorted: every pytest-xdist worker must collect the same ids in the same order
CLASSES = tuple(sorted({cls for cls, _ in schedulers.SCHEDULERS.values() if cls.diffusers_class},
                       key=lambda c: c.__name__))

# scheduler_config.json of the models sdx targets, as their hub repos ship them
SD15 = {"_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0", "beta_end": 0.012,
        "beta_schedule": "scaled_linear", "beta_start": 0.00085, "num_train_timesteps": 1000,
        "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None,
        "clip_sample": False}
SD21 = {"_class_name": "DDIMScheduler", "_diffusers_version": "0.8.0", "beta_end": 0.012,
        "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False, "num_train_timesteps": 1000,
        "prediction_type": "v_prediction", "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
        "trained_betas": None}
SDXL = {"_class_name": "EulerDiscreteScheduler", "_diffusers_version": "0.19.0.dev0", "beta_end": 0.012,
        "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False, "interpolation_type": "linear",
        "num_train_timesteps": 1000, "prediction_type": "epsilon", "sample_max_value": 1.0, "set_alpha_to_one": False,
        "skip_prk_steps": True, "steps_offset": 1, "timestep_spacing": "leading", "trained_betas": None,
        "use_karras_sigmas": False}
PIX2PIX = {"_class_name": "EulerAncestralDiscreteScheduler", "_diffusers_version": "0.13.0.dev0", "beta_end": 0.012,
           "beta_schedule": "scaled_linear", "beta_start": 0.00085, "num_train_timesteps": 1000,
           "prediction_type": "epsilon", "steps_offset": 1, "trained_betas": None}
MODELS = {"sd15": SD15, "sd21": SD21, "sdxl": SDXL, "pix2pix": PIX2PIX}
EDM_CONFIG = {"_class_name": "EDMDPMSolverMultistepScheduler", "sigma_min": 0.002, "sigma_max": 80.0,
              "sigma_data": 0.5, "num_train_timesteps": 1000, "prediction_type": "epsilon", "rho": 7.0}
# what diffusers does for each --scheduler name: XScheduler.from_config(config, **kwargs); a name without a
# ladder suffix turns off the ladders the class has
PLAIN = {"use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False}
SDE = {"algorithm_type": "sde-dpmsolver++"}
DIFFUSERS_NAMES = {
    "euler": ("EulerDiscreteScheduler", PLAIN), "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", PLAIN), "ddim": ("DDIMScheduler", {}), "ddpm": ("DDPMScheduler", {}),
    "pndm": ("PNDMScheduler", {}), "lms": ("LMSDiscreteScheduler", PLAIN),
    "unipc": ("UniPCMultistepScheduler", PLAIN), "deis": ("DEISMultistepScheduler", PLAIN),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", {**PLAIN, "solver_order": 2}),
    "dpmpp_2m_karras": ("DPMSolverMultistepScheduler", {**PLAIN, "use_karras_sigmas": True, "solver_order": 2}),
    "dpmpp_2m_sde": ("DPMSolverMultistepScheduler", {**PLAIN, **SDE, "solver_order": 2}),
    "dpmpp_2m_sde_karras": ("DPMSolverMultistepScheduler", {**PLAIN, **SDE, "solver_order": 2,
                                                            "use_karras_sigmas": True}),
    "dpmpp_2m_sde_heun": ("DPMSolverMultistepScheduler", {**PLAIN, **SDE, "solver_order": 2, "solver_type": "heun"}),
    "dpmpp_3m_sde": ("DPMSolverMultistepScheduler", {**PLAIN, **SDE, "solver_order": 3, "solver_type": "heun",
                                                     "lower_order_final": False}),
    "dpmpp_2s": ("DPMSolverSinglestepScheduler", {**PLAIN, "solver_order": 2, "algorithm_type": "dpmsolver++"}),
    "dpmpp_3s": ("DPMSolverSinglestepScheduler", {**PLAIN, "solver_order": 3, "algorithm_type": "dpmsolver++"}),
    "dpmpp_sde": ("DPMSolverSDEScheduler", PLAIN), "dpmpp_sde_karras": ("DPMSolverSDEScheduler",
                                                                        {**PLAIN, "use_karras_sigmas": True}),
    "dpm2": ("KDPM2DiscreteScheduler", PLAIN), "dpm2_a": ("KDPM2AncestralDiscreteScheduler", PLAIN),
    "dpm2_a_beta": ("KDPM2AncestralDiscreteScheduler", {**PLAIN, "use_beta_sigmas": True}),
    "lcm": ("LCMScheduler", {}), "tcd": ("TCDScheduler", {}),
    "edm_euler": ("EDMEulerScheduler", {}), "edm_euler_exponential": ("EDMEulerScheduler",
                                                                      {"sigma_schedule": "exponential"}),
    "edm_dpmpp_2m": ("EDMDPMSolverMultistepScheduler", {"solver_order": 2, "algorithm_type": "dpmsolver++"}),
    "edm_dpmpp_2m_sde": ("EDMDPMSolverMultistepScheduler", {"solver_order": 2, **SDE}),
}


def test_every_name_has_a_diffusers_counterpart_here():
    """dpmpp_2s_a alone has no diffusers class (k-diffusion is its reference)."""
    assert set(schedulers.SCHEDULERS) - set(DIFFUSERS_NAMES) == {"dpmpp_2s_a"}


def diffusers_params(cls):
    params = inspect.signature(getattr(diffusers, cls.diffusers_class).__init__).parameters
    return {k: p.default for k, p in params.items() if k != "self"}


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_diffusers_field_is_honoured_or_refused(cls):
    """No diffusers field falls through to a silent default: each is a field of ours (with diffusers' default),
    one we accept at fixed values only, or one that cannot change our math."""
    ours = {f.name: f.default for f in dataclasses.fields(cls)}
    for name, default in diffusers_params(cls).items():
        assert name in ours or name in cls.fixed or name in cls.inert, f"{cls.__name__} ignores {name}"
        if name in ours:
            assert ours[name] == (tuple(default) if isinstance(default, list) else default), name
        elif name in cls.fixed:
            assert default in cls.fixed[name], name


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", list(DIFFUSERS_NAMES))
def test_names_on_real_model_configs_match_diffusers_from_config(name, model):
    config = EDM_CONFIG if name.startswith("edm") else MODELS[model]
    sched = schedulers.from_name(name, config)
    class_name, kwargs = DIFFUSERS_NAMES[name]
    ref = getattr(diffusers, class_name).from_config(config, **kwargs)
    for f in dataclasses.fields(sched):
        if f.name in ref.config and f.name in diffusers_params(type(sched)):
            expected = ref.config[f.name]
            assert getattr(sched, f.name) == (tuple(expected) if isinstance(expected, list) else expected), f.name
    ref.set_timesteps(25)
    np.testing.assert_allclose(sched.timesteps(25), ref.timesteps.numpy().astype(np.float32), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("model", MODELS)
def test_from_config_picks_the_models_class(model):
    sched = schedulers.from_config(MODELS[model])
    assert sched.diffusers_class == MODELS[model]["_class_name"]
    assert sched.prediction_type == MODELS[model].get("prediction_type", "epsilon")


def test_name_fixes_the_algorithm_on_a_multistep_config():
    unipc = {**SDXL, "_class_name": "UniPCMultistepScheduler", "solver_type": "bh2", "solver_order": 3,
             "use_karras_sigmas": True}
    sched = schedulers.from_name("dpmpp_2m", unipc)
    assert (sched.solver_type, sched.solver_order, sched.use_karras_sigmas) == ("midpoint", 2, False)
    assert schedulers.from_name("dpmpp_2m_karras", SDXL).use_karras_sigmas
    assert schedulers.from_name("unipc", {**SDXL, "solver_type": "heun"}).solver_type == "bh2"


def test_use_default_values_and_other_classes_fields_are_ignored():
    config = {**SDXL, "timestep_spacing": "trailing", "_use_default_values": ["timestep_spacing"],
              "variance_type": "learned_range", "thresholding": True}  # DDPM/DDIM fields: not Euler's
    assert schedulers.from_config(config).timestep_spacing == "linspace"  # EulerDiscreteScheduler's default


@pytest.mark.parametrize("name,config,field", [
    ("euler", {"prediction_type": "flow_prediction"}, "prediction_type"),
    ("euler_a", {"prediction_type": "sample"}, "prediction_type"),
    ("pndm", {"prediction_type": "sample"}, "prediction_type"),
    ("ddim", {"beta_schedule": "sigmoid"}, "beta_schedule"),
    ("ddim", {"thresholding": True}, "thresholding"),
    ("ddim", {"timestep_spacing": "karras"}, "timestep_spacing"),
    ("ddpm", {"variance_type": "learned_range"}, "variance_type"),
    ("ddpm", {"variance_type": "fixed_large_log"}, "variance_type"),
    ("euler_a_karras", {}, "euler_a has no karras sigmas"),
    ("dpm2", {"prediction_type": "sample"}, "prediction_type"),
    ("dpmpp_sde", {"prediction_type": "sample"}, "prediction_type"),
    ("dpmpp_2s", {"thresholding": True}, "thresholding"),
    ("dpmpp_2s", {"variance_type": "learned"}, "variance_type"),
    ("lcm", {"thresholding": True}, "thresholding"),
    ("deis", {"use_flow_sigmas": True}, "use_flow_sigmas"),
    ("edm_euler", {"sigma_schedule": "linear"}, "sigma_schedule"),
    ("edm_euler", {"sigma_min": 90.0}, "sigma_min"),
    ("edm_dpmpp_2m", {"thresholding": True}, "thresholding"),
    ("DPM++ adaptive", {}, "unknown scheduler"),
    ("euler", {"interpolation_type": "cubic"}, "interpolation_type"),
    ("euler", {"final_sigmas_type": "max"}, "final_sigmas_type"),
    ("dpmpp_2m", {"variance_type": "learned"}, "variance_type"),
    ("dpmpp_2m", {"use_lu_lambdas": True}, "use_lu_lambdas"),
    ("dpmpp_2m", {"use_flow_sigmas": True}, "use_flow_sigmas"),
    ("unipc", {"solver_order": 4}, "solver_order"),
    ("unipc", {"solver_p": {"_class_name": "DPMSolverMultistepScheduler"}}, "solver_p"),
    ("unipc", {"solver_type": "bh1"}, "solver_type"),  # with final_sigmas_type="zero": NaN in diffusers
    ("unipc", {"predict_x0": False}, "predict_x0"),
    ("heun", {"rescale_betas_zero_snr": True}, "rescale_betas_zero_snr"),  # Heun cannot follow the model
    ("pndm", {"rescale_betas_zero_snr": True}, "rescale_betas_zero_snr"),
    ("ddim", {"timestep_type": "continuous"}, "timestep_type"),
    ("nope", {}, "nope"),
])
def test_unsupported_values_are_errors_naming_the_field(name, config, field):
    with pytest.raises(SdxError, match=field):
        schedulers.from_name(name, {**SDXL, **config})


@pytest.mark.parametrize("class_name", ["DPMSolverMultistepScheduler", "DPMSolverSinglestepScheduler",
                                        "EDMDPMSolverMultistepScheduler"])
def test_noise_prediction_dpm_solvers_are_errors(class_name):
    """diffusers' deprecated noise-prediction forms ("dpmsolver", "sde-dpmsolver") are not implemented."""
    for algorithm in ("dpmsolver", "sde-dpmsolver"):
        with pytest.raises(SdxError, match=f"algorithm_type='{algorithm}'"):
            schedulers.from_config({**SDXL, "_class_name": class_name, "algorithm_type": algorithm,
                                    "final_sigmas_type": "sigma_min"})


@pytest.mark.parametrize("class_name", ["EulerDiscreteScheduler", "KDPM2DiscreteScheduler", "DEISMultistepScheduler"])
def test_two_sigma_ladders_at_once_are_an_error(class_name):
    with pytest.raises(SdxError, match="use_exponential_sigmas and use_beta_sigmas"):
        schedulers.from_config({**SDXL, "_class_name": class_name, "use_exponential_sigmas": True,
                                "use_beta_sigmas": True})


def test_unknown_class_is_an_error_listing_the_choices():
    with pytest.raises(SdxError, match="FlowMatchEulerDiscreteScheduler.*--scheduler"):
        schedulers.from_config({**SDXL, "_class_name": "FlowMatchEulerDiscreteScheduler"})


@pytest.mark.parametrize("typed,name", [
    ("DPM++ 2M SDE Karras", "dpmpp_2m_sde_karras"), ("dpmpp_2m_sde_gpu", "dpmpp_2m_sde"),
    ("euler_ancestral", "euler_a"), ("Euler a", "euler_a"), ("DPM++ 2S a", "dpmpp_2s_a"),
    ("DPM++ SDE Karras", "dpmpp_sde_karras"), ("DPM2 a Karras", "dpm2_a_karras"), ("DPM2", "dpm2"),
    ("dpm_2_ancestral", "dpm2_a"), ("DPM++ 3M SDE Exponential", "dpmpp_3m_sde_exponential"),
    ("dpmpp_3m_sde_gpu", "dpmpp_3m_sde"), ("dpmpp_sde_gpu", "dpmpp_sde"), ("LMS Karras", "lms_karras"),
    ("PLMS", "pndm"), ("uni_pc", "unipc"), ("LCM", "lcm"), ("DPM++ 2M SDE Heun", "dpmpp_2m_sde_heun"),
    ("dpmpp_2m_sde_gpu_karras", "dpmpp_2m_sde_karras"), ("DDIM", "ddim"), ("DEIS", "deis"),
])
def test_typed_names_resolve_to_sdx_names(typed, name):
    assert schedulers.canonical(typed) == name
    assert schedulers.from_name(typed, SDXL) == schedulers.from_name(name, SDXL)


def test_help_lists_every_name_and_its_ladders():
    text = names.help_text()
    assert all(name in text for name in schedulers.SCHEDULERS)
    assert "dpmpp_2m_sde [karras/exponential/beta]" in text and "edm_euler [karras/exponential]" in text


def test_edm_third_order_sde_is_an_error():
    with pytest.raises(SdxError, match="solver_order=3"):
        schedulers.from_config({**EDM_CONFIG, "algorithm_type": "sde-dpmsolver++", "solver_order": 3})


def test_an_edm_model_takes_only_edm_samplers():
    assert type(schedulers.from_config(EDM_CONFIG)).__name__ == "EDMDPMSolverMultistep"
    with pytest.raises(SdxError, match="EDM formulation.*edm_euler"):
        schedulers.from_name("euler", EDM_CONFIG)
    with pytest.raises(SdxError, match="noise levels"):
        schedulers.denoising_range(schedulers.from_config(EDM_CONFIG), 10, denoising_end=0.8)
    assert schedulers.denoising_range(schedulers.from_config(EDM_CONFIG), 10, strength=0.5) == (5, 10)


def test_distilled_schedules_refuse_more_steps_than_distilled():
    with pytest.raises(SdxError, match="original_inference_steps=50"):
        schedulers.from_name("lcm", SDXL).set_timesteps(51, (1, 4, 8, 8))
    with pytest.raises(SdxError, match="original_inference_steps=2000"):
        schedulers.from_config({**SDXL, "_class_name": "TCDScheduler", "original_inference_steps": 2000}).timesteps(4)
    with pytest.raises(SdxError, match="eta"):
        schedulers.from_name("tcd", SDXL).from_config(SDXL, eta=1.5)


def test_zero_snr_with_epsilon_at_t999_is_an_error():
    sched = schedulers.from_name("ddim", {**SDXL, "rescale_betas_zero_snr": True, "timestep_spacing": "trailing"})
    with pytest.raises(SdxError, match="no signal"):
        sched.set_timesteps(10, (1, 4, 8, 8))


@pytest.mark.parametrize("steps", [0, -3, 2.5])
def test_bad_step_counts_are_errors(steps):
    with pytest.raises(SdxError, match="num_inference_steps"):
        schedulers.from_name("euler", SDXL).set_timesteps(steps, (1, 4, 8, 8))


@pytest.mark.parametrize("beta", [{"beta_schedule": "linear"}, {"beta_schedule": "scaled_linear", "beta_start": 0.00085,
                                  "beta_end": 0.012}, {"beta_schedule": "squaredcos_cap_v2"},
                                  {"trained_betas": list(np.linspace(1e-4, 0.03, 1000))},
                                  {"beta_schedule": "linear", "num_train_timesteps": 777}])
@pytest.mark.parametrize("zero_snr", [False, True])
def test_alphas_cumprod_bitwise_like_diffusers(beta, zero_snr):
    for cls in (DDPM, Euler):
        config = {**beta, "rescale_betas_zero_snr": zero_snr}
        ours = cls.from_config(config).alphas_cumprod
        ref = getattr(diffusers, cls.diffusers_class).from_config(config).alphas_cumprod.numpy()
        if zero_snr:  # the rescale goes through torch's CPU sqrt, which is not always correctly rounded
            np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-12)
        else:
            np.testing.assert_array_equal(ours, ref)


def test_state_is_a_pytree_of_float32_arrays_and_table_rows_line_up():
    sched = schedulers.from_name("heun", SDXL)
    state = sched.set_timesteps(10, (1, 8, 8, 4), begin=4)
    assert state.num_calls == len(sched.timesteps(10)) - 4 == 15
    for leaf in (state.timesteps, state.init_noise_sigma, state.noise_scales, *state.table.values(),
                 *state.history.values()):
        assert leaf.dtype == jnp.float32
    assert all(v.shape[0] == state.num_calls for v in state.table.values())
    assert state.history["sample"].shape == (1, 8, 8, 4)


# ----------------------------------------------------------------------------------------------------------
# denoising_range: the pipelines' cuts (numerically checked against diffusers in test_schedulers_parity)

def test_denoising_range_strength_and_second_order_rule():
    euler, heun = schedulers.from_name("euler", SDXL), schedulers.from_name("heun", SDXL)
    assert schedulers.denoising_range(euler, 10, strength=0.6) == (4, 10)
    assert schedulers.denoising_range(heun, 10, strength=0.6) == (8, 19)
    begin, end = schedulers.denoising_range(heun, 10, denoising_start=0.8)
    assert (end - begin) % 2 == 1  # never starts between the two calls of a Heun step
    assert schedulers.denoising_range(euler, 10, denoising_end=0.8) == (0, 8)


@pytest.mark.parametrize("kwargs,match", [
    (dict(strength=1.5), "strength"), (dict(denoising_start=1.0), "denoising_start"),
    (dict(denoising_end=0.0), "denoising_end"), (dict(denoising_start=0.8, denoising_end=0.5), "below"),
    (dict(strength=0.05), "no denoising step"),
])
def test_denoising_range_errors(kwargs, match):
    with pytest.raises(SdxError, match=match):
        schedulers.denoising_range(schedulers.from_name("euler", SDXL), 10, **kwargs)


# ----------------------------------------------------------------------------------------------------------
# Training targets against DDPMScheduler and diffusers.training_utils.compute_snr

@pytest.mark.parametrize("config", [SD21, {**SDXL, "rescale_betas_zero_snr": True},
                                    {"beta_schedule": "squaredcos_cap_v2"}])
def test_training_targets_match_diffusers(config):
    sched = schedulers.from_name("ddpm", config)
    ref = diffusers.DDPMScheduler.from_config(config)
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((4, 8, 8, 4), dtype=np.float32)
    noise = rng.standard_normal((4, 8, 8, 4), dtype=np.float32)
    t = np.array([0, 17, 500, 999])
    tx0, tnoise, tt = torch.from_numpy(x0), torch.from_numpy(noise), torch.from_numpy(t)
    np.testing.assert_allclose(training.add_noise(sched, x0, noise, t), ref.add_noise(tx0, tnoise, tt).numpy(),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(training.get_velocity(sched, x0, noise, t),
                               ref.get_velocity(tx0, tnoise, tt).numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(training.snr(sched, t), compute_snr(ref, tt).numpy(), rtol=1e-6)


def test_a_steps_offset_past_the_schedule_is_one_error():
    """diffusers indexes past alphas_cumprod (an IndexError); sdx names the field."""
    sched = schedulers.from_config({**SD15, "steps_offset": 500})
    with pytest.raises(SdxError, match="steps_offset=500 puts timestep 1400 past the 1000 training timesteps"):
        sched.set_timesteps(10, (1, 4, 4, 4))
