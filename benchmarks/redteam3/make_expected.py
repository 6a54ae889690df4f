"""Writes expected.json for the third red-team hold-out set. Every value was derived
independently of nanhunt (none of nanhunt's source under nanhunt/ was read while writing this
set, nor the scripts of the first two sets): by reasoning about each script and checking it with
the first set's reference tools, benchmarks/redteam/tools/locate_first.py (TorchDispatchMode
locator of the first op that makes a non-finite value from finite inputs, and --flush for
fp32->fp16 gradient casts that flush to zero), tools/gradnorms.py (per-module unscaled gradient
norms per step), a GradScaler.update trace (scale before/after each update: skipped steps), and
float32 / fixed controls of the same script (--fp32, --fixed, --lr, --clip, --normalize,
--impute, --init-scale, --scale, --scaler, --mean). The figures in each note were measured that
way on the shared 2-core CPU box (OMP_NUM_THREADS=1, torch 2.13 CPU).

Fields are run.py's: exit, phase, kind, module, step (secondary), fix (secondary), class;
a list = any of these is right; null = not checked. Module names are qualified names from
named_modules() of the root model ("" = the root / no module owns it; it also matches null).

Kinds beyond nanhunt's vocabulary: `stall` (the run learns measurably less than its float32
twin, with no NaN/Inf anywhere). The loss-scale, lr and underflow scripts that produce no NaN
in the loss use nanhunt's kinds.
"""
from pathlib import Path
import json

E = {}


def add(script, cls, exit, phase=None, kind=None, module=None, step=None, notes="", fix=None,
        nonfinite=True):
    E[script] = dict(exit=exit, phase=phase, kind=kind, module=module, step=step, notes=notes,
                     fix=fix or [], nonfinite_in_loss=nonfinite, **{"class": cls})


BW, FW, OPT, LS, DATA = "backward", "forward", "optimizer", "loss_scaling", "data"

# 1. forward overflow in fp16 autocast
add("a01_gpt_wide_head_attention.py", "1-forward-overflow", 1, FW, "overflow", "blocks.0.attn", 0,
    "embeddings x sqrt(d) (N(0,1) init, d=1024), LeCun-init qkv, head_dim 512, q@k^T before the "
    "/sqrt(hd): locator first non-finite = aten.bmm in blocks.0.attn forward at step 0 (1212/7688 inf, "
    "inputs amax 205), every step; loss NaN; fp32 (12 steps) 4.35, --fixed (q scaled before the "
    "matmul) fp16 4.38, finite", ["fp32_module"])
add("a02_gin_hub_sum_aggregation.py", "1-forward-overflow", 1, FW, "overflow", "convs.2", 0,
    "3-layer GIN, sum aggregation adj @ h, 5 hubs of degree ~1350: locator first non-finite = aten.mm "
    "(adj @ h) in convs.2 forward at step 0 (85 inf, input amax 674), every step; fp16 loss NaN from "
    "step 0; fp32 168.6 -> 6.17 (finite); --mean (row-normalised adj) fp16 1.38 -> 1.28",
    ["fp32_module", "normalize_input"])
add("a03_tabular_mlp_sum_squares.py", "1-forward-overflow", 1, FW, "overflow", "", 0,
    "table kept in fp16, loss ((pred-y)**2).sum()/numel over 4096x32: locator first non-finite = "
    "aten.sum (fp16, input amax 4.7) at the loss line, top level (no module), step 0 and every step: "
    "the loss prints inf for 12/12 steps (gradients stay finite); fp32 and --fixed (F.mse_loss in "
    "fp32) both 1.02 -> 0.966", ["fp32_module"])

# 2. invalid-op NaN
add("b01_transformer_padded_batch_classifier.py", "2-nan-op", 1, FW, "nan_op", "attn", 12,
    "empty documents (length 0) -> key-padding row all -inf -> softmax NaN in attn. The locator "
    "reports nothing (masked_fill writes -inf by design; softmax's input is already non-finite), so "
    "the step comes from the loss: NaN only at step 12 (batch 192..207 holds document 200); "
    "fp16+GradScaler skips that step and recovers; fp32 applies the NaN grads, NaN from step 12 on; "
    "--fixed (drop empty docs) 0.70 at step 19, finite", ["fix_data", "clamp"])
add("b02_cnn_handwritten_cross_entropy.py", "2-nan-op", 1, FW, "nan_op", "", 12,
    "hand-written CE: log(softmax) in fp16; once a non-target prob underflows to 0, log -> -inf and "
    "0 * -inf = NaN. Locator: step 0 = GradScaler calibration (the 65536 loss-grad seed cast to fp16 is "
    "inf, one skipped step), then aten.log at the loss line, top level, step 12 (4 inf), NaN every step "
    "after (weights frozen by skips); fp32 2.32 -> 0.0004, --fixed (F.cross_entropy fp32) -> 0.0000",
    ["fp32_module", "clamp", "eps"])
add("b03_unet_depth_silog_loss.py", "2-nan-op", 1, FW, "nan_op", "", 1,
    "ReLU depth head, log(pred + 1e-8) in fp16: 1e-8 rounds to 0, pred = 0 -> log -> -inf -> SILog "
    "inf - inf = NaN. Locator: step 0 = scaled-gradient overflow (GradScaler calibration skip, "
    "head.0 conv backward), then aten.log at the loss line (top level, no module) from step 1 "
    "(steps 1,2,3,5,6,...); fp16 loss NaN on 9 of 12 steps; fp32 5.38 -> 1.22 (no NaN); --fixed "
    "(log in fp32) finite, 2.24 at step 14", ["eps", "fp32_module", "clamp"])

# 3. backward underflow without GradScaler (no NaN/Inf anywhere)
add("c01_lstm_minute_returns_forecaster.py", "3-underflow-backward", 1, BW, "underflow", ["head", ""], 0,
    "minute returns ~1e-5, zero-init head, MSE over 64x48: locator --flush: 3072/3072 flushed at the "
    "fp16 cast of head's output grad (ToCopyBackward of pred.float(), src amax 2.4e-8) every step; "
    "fp16 loss 9.83e-11 -> 9.29e-11 (30 steps, noise only), fp32 -> 3.98e-11, --scaler fp16 -> 3.99e-11",
    ["grad_scaler", "init_scale"], nonfinite=False)
add("c02_unet_plate_displacement_surrogate.py", "3-underflow-backward", 1, BW, "underflow", ["out", ""], 0,
    "targets ~1e-5 m, zero-init output conv: locator --flush: 4096/4096 flushed at the fp16 cast of "
    "out's output grad (src amax 2.3e-9) every step; fp16 loss 3.21e-12 -> 3.03e-12 at step 9 (noise "
    "only), fp32 -> 4.17e-13 at step 19, --scaler fp16 -> 3.13e-13", ["grad_scaler", "init_scale"],
    nonfinite=False)
add("c03_conv1d_tts_postnet_per_frame.py", "3-underflow-backward", 1, BW, "underflow", ["4", ""], 0,
    "MSE / (batch * frames) over 2x40x400: locator --flush: 26609/32000 flushed + 5391 subnormal at "
    "the fp16 cast of the last conv ('4') output grad (src amax 5.7e-8) every step; partial underflow: "
    "fp16 8.77e-5 -> 6.51e-5 vs fp32 -> 5.76e-5 in 20 steps (fp16 makes 75% of fp32's progress and "
    "is flat from step 9: 6.86e-5 -> 6.51e-5 vs fp32 5.80e-5 -> 5.76e-5)", ["grad_scaler", "init_scale"],
    nonfinite=False)

# 4. exploding gradients
add("d01_tanh_rnn_orthogonal_gain_copy.py", "4-exploding-gradient", 1, BW, "exploding_gradient", "rnn", 0,
    "orthogonal W_hh gain 3, 60 steps: fp32 unscaled grad norms step 0 rnn 8.4e7 / emb 5.1e6 / out "
    "1.22 (steps 1-2: 1e7-9e7); fp16: locator first non-finite = aten.add in rnn's backward at step 0 "
    "(and 1, 2, ...: GradScaler skips); fp16 loss 2.17 -> 2.15 (no learning); fp32 2.21 at step 24; "
    "--clip 1: 2.23 (the task is hard; the explosion is not an fp16 effect)", ["clip_grad_norm"])
add("d02_ggnn_shared_rounds_sum.py", "4-exploding-gradient", 1, BW, "exploding_gradient",
    ["prop", "prop.msg_lin", "prop.self_lin"], 0,
    "one shared propagation step x30 rounds, sum aggregation, orthogonal gain 1.5: fp32 unscaled grad "
    "norms step 0 prop.msg_lin 4.0e6, inp 2.7e6, prop.self_lin 5.7e5, readout 1.84; fp16: locator first "
    "non-finite = aten.mm in prop.msg_lin backward at step 0; fp16 loss 0.40 -> 0.38 (flat)",
    ["clip_grad_norm"])
add("d03_conv_rnn_keyword_spotter.py", "4-exploding-gradient", 1, BW, "exploding_gradient", "rnn", 0,
    "conv front-end + tanh nn.RNN over 64 frames, W_hh orthogonal gain 2.5: fp32 unscaled grad norms "
    "step 0 rnn 1.88e6, front.0 3.3e5, cls 1.25; fp16: locator first non-finite = aten.add in rnn's "
    "backward at step 0; fp16 loss 1.54 -> 1.56 at step 19; fp32 1.63 at step 24; --clip 1: 1.45",
    ["clip_grad_norm"])

# 5. learning rate too high
add("e01_gpt_adam_lr_high.py", "5-lr-too-high", 1, [BW, FW, OPT], "lr_too_high",
    ["blocks.0", "blocks.0.attn", "head", ""], 1,
    "Adam lr 0.5: loss 3.73 -> 9.98 (step 1) -> 17.7 (step 5) -> NaN from step 6; locator: scaled-grad "
    "overflow in head's backward at steps 1 and 3 (skips), then forward overflow of q@k^T in blocks.0 "
    "at step 6 (weights grown by the huge updates); lr 0.05: 3.73 -> 0.0009, lr 1e-3: -> 0.81, finite",
    ["lower_lr"])
add("e02_cnn_sgd_lr_high_bf16.py", "5-lr-too-high", 1, [OPT, BW, FW], ["lr_too_high", "divergence"], None, None,
    "SGD momentum 0.9, lr 1.0, bf16 autocast: no NaN/Inf; loss 2.32 -> spikes 6.7 (step 7), 8.7 (9), "
    "10.4 (16), ends 2.55 at step 24 (no learning); lr 0.05: 2.32 -> 0.70", ["lower_lr"], nonfinite=False)
add("e03_tabular_mlp_adam_lr_high_bf16.py", "5-lr-too-high", 1, [OPT, BW, FW], ["lr_too_high", "divergence"],
    None, None,
    "AdamW lr 0.3, bf16 autocast: no NaN/Inf; loss 1.10 -> 46 (step 1) -> 281 (step 2), settles near "
    "0.92-1.0 (0.997 at step 39), worse than its start; lr 1e-3: 1.10 -> 0.41", ["lower_lr"],
    nonfinite=False)

# 6. bad data
add("f01_tabular_mlp_missing_value_row.py", "6-bad-data", 1, DATA, "bad_input", None, 7,
    "X[7*64+13, 5] = NaN (missing income): locator reports no op (the NaN enters as data); loss NaN at "
    "step 7 only (GradScaler skips it, training continues: 0.39 at step 19); --impute finite",
    ["fix_data"])
add("f02_cnn_per_image_standardisation.py", "6-bad-data", 1, DATA, "bad_input", None, 5,
    "saturated all-white frame at step 5: per-image (x-mean)/std with std 0 -> 0/0; locator first "
    "non-finite = aten.div (fp32, 64 NaN) at the standardisation line in the data pipeline (top "
    "level, outside the model) at step 5; bf16 without scaler applies the NaN grads: loss NaN from "
    "step 5 to the end; --fixed (std + 1e-6) finite", ["fix_data", "normalize_input"])
add("f03_gru_barometer_pascal.py", "6-bad-data", 1, [DATA, FW], "bad_input", None, 0,
    "pressure logged in Pa (~1.013e5 > fp16 max 65504): locator first non-finite = aten._to_copy (the "
    "autocast cast of the input, 768/2304 inf, input amax 1.02e5) in enc's forward at step 0 and "
    "every step; loss NaN all 15 steps", ["normalize_input", "fix_data"])

# 7. loss-scale problems
add("g01_gpt_init_scale_2pow40.py", "7-loss-scale", 1, [LS, BW], "loss_scale", None, 0,
    "init_scale 2^40 in a 30-step run: scaler trace: steps 0..20 skipped (21 backoffs, 2^40 -> 2^19); "
    "locator: the scaled grad overflows at the fp16 cast of logits.float() (ToCopyBackward, all 16384 "
    "inf) at each of those steps; loss 3.73 flat for 22 steps (no NaN in the loss), 1.25 at step 29 vs "
    "0.058 with --init-scale 65536",
    ["init_scale"], nonfinite=False)
add("g02_unet_scaler_inside_loop.py", "7-loss-scale", 1, [LS, BW], "loss_scale", None, 0,
    "a fresh GradScaler (scale 65536) every step, summed loss: the scaled grads overflow every step "
    "(locator: convolution_backward in 'out' at step 0, every step), every step skipped, the scale never "
    "backs off: loss ~59 flat for 20 steps (no NaN in the loss); --fixed (one scaler): 8 calibration "
    "skips then 59 -> 17.6", ["scaler_usage"], nonfinite=False)
add("g03_conv1d_static_loss_scale.py", "7-loss-scale", 1, [BW, LS], "loss_scale", None, 0,
    "manual static (loss*65536).backward() on a pure-fp16 model with a summed loss: locator first "
    "non-finite = aten.mm in the backward of Linear '6' at step 0 (input amax 5.1e4), the inf/65536 "
    "grads reach the fp32 master weights: loss NaN from step 1; --scale 128: 22.9 -> 20.1, finite",
    ["grad_scaler", "init_scale", "scaler_usage"])

# 8. no-NaN instabilities: stall (updates lost to rounding in low-precision weights)
add("h01_gcn_bf16_weights_sgd.py", "8-no-nan-stall", 1, OPT, "stall", None, None,
    "whole GCN in bf16, SGD lr 1e-3 momentum 0.9: no NaN/Inf; loss 1.3743 -> 1.3056 in 40 steps vs "
    "fp32 1.3726 -> 1.2872 (bf16 makes 81% of fp32's progress; at lr 2e-3: 1.2482 vs 1.2285)",
    ["fp32_master"], nonfinite=False)
add("h02_gpt_bf16_weights_sgd.py", "8-no-nan-stall", 1, OPT, "stall", None, None,
    "whole GPT in bf16, SGD lr 1e-3 momentum 0.9: no NaN/Inf; loss 3.7185 -> 3.5332 in 30 steps vs "
    "fp32 3.7112 -> 3.4756 (bf16 makes 78% of fp32's progress)", ["fp32_master"], nonfinite=False)
add("h03_lstm_bf16_weights_adam.py", "8-no-nan-stall", 1, OPT, "stall", None, None,
    "whole nn.LSTM classifier in bf16, Adam lr 1.5e-4 (updates below half the bf16 spacing of most "
    "weights): no NaN/Inf; loss 0.686 -> 0.631 in 40 steps vs fp32 0.684 -> 0.599 (bf16 makes 65% of "
    "fp32's progress)", ["fp32_master"], nonfinite=False)

# 9. first-run-only failure (a re-run does not reproduce it)
add("i01_tabular_first_run_stats_cache.py", "9-first-run-only", 1, DATA, "bad_input", None, 0,
    "without the stats cache (./feature_stats.json or $FEATURE_STATS_CACHE) the standardisation "
    "statistics come from the first shard, where 'discount' is constant: std 0 -> x/0; locator first "
    "non-finite = aten.div at the standardisation line (top level, 256 NaN + 1792 inf) before step 0; "
    "loss NaN every step. The run then writes the cache; a second run in the same folder is healthy "
    "(0.72 -> 0.48). nanhunt must not claim a verified fix from a re-run", ["fix_data"])

# healthy runs that look scary
HEALTHY = {
    "k01_gpt_spike_recovers.py": "one random-token batch at step 12: loss 0.72 -> 4.41 -> 0.53 next step, "
    "0.079 at step 29; no NaN, no skips after calibration",
    "k02_cnn_scaler_growth_interval_3.py": "GradScaler(init_scale 2^10, growth_interval 3), summed CE: "
    "scaler trace: 5 skips at steps 10, 15, 19, 23, 27, the scale cycling 4096 <-> 8192 after growing from "
    "1024; loss/sample 2.33 -> 0.10 in 30 steps",
    "k03_lstm_bf16_cosine_warm_restarts.py": "bf16 autocast, CosineAnnealingWarmRestarts(T_0=8): loss bumps "
    "after each restart (steps 8, 16, 24), 2.74 -> 0.067 in 32 steps, no NaN",
    "k04_gin_calibration_skips.py": "init_scale 2^24: 6 skipped calibration steps (2^24 -> 2^18), one later "
    "backoff, then learns 0.68 -> 0.52 in 40 steps",
}
for s, n in HEALTHY.items():
    add(s, "healthy", 0, notes=n, nonfinite=False)

if __name__ == "__main__":
    out = Path(__file__).with_name("expected.json")
    out.write_text(json.dumps(E, indent=1) + "\n")
    print(f"wrote {out}: {len(E)} scripts")
