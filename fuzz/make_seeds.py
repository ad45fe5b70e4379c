#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz targets into fuzz/corpus/<target>/ (small valid files and
slightly broken ones). Run from anywhere; it only (re)writes files named seed-*. The JPEG and HDR
seeds (seed-*.jpg, seed-*.hdr) were made once with stb_image_write and are kept as they are; inputs
that once crashed a target are kept as crash-* files (see docs/testing.md)."""
import gzip
import json
import os
import struct
import zlib

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FMNIST = "/usr/share/datasets/fashion-mnist"


def put(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


# ---- safetensors -------------------------------------------------------------------------------
def safetensors(tensors, metadata=None, pad=True):
    """tensors: list of (name, dtype, shape, bytes)."""
    header, offset, blob = {}, 0, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blob += data
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + blob


def f32(*v):
    return struct.pack("<%df" % len(v), *v)


def i64(*v):
    return struct.pack("<%dq" % len(v), *v)


st = "safetensors"
put(st, "f32.safetensors", safetensors([("w", "F32", [2, 2], f32(1, 2, 3, 4))], {"format": "x"}))
put(st, "mixed.safetensors", safetensors([
    ("a", "U8", [3], b"\x01\x02\x03"), ("b", "BOOL", [2], b"\x00\x01"), ("c", "I64", [1], i64(-5)),
    ("d", "F16", [2], b"\x00\x3c\x00\xc0"), ("e", "BF16", [1], b"\x80\x3f"), ("f", "I32", [0, 4], b""),
    ("g", "F64", [], struct.pack("<d", 0.5)), ("h", "I16", [1], b"\x01\x00"), ("i", "I8", [1], b"\xff")]))
put(st, "empty.safetensors", safetensors([]))
put(st, "truncated.safetensors", safetensors([("w", "F32", [2, 2], f32(1, 2, 3, 4))])[:-3])
overlap = b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}'
put(st, "overlap.safetensors", struct.pack("<Q", len(overlap)) + overlap + b"\x00" * 3)
put(st, "bad-bool.safetensors", safetensors([("b", "BOOL", [2], b"\x00\x07")]))
# A latent shard's sample with text encodings, of the shapes the target's record gives (z 2, 2x2; 3 tokens of 4; pooled 4).
put(st, "encoded-sample.safetensors", safetensors([
    ("mean", "F32", [2, 2, 2], f32(*range(8))), ("logvar", "F32", [2, 2, 2], f32(*range(8))),
    ("context", "F32", [3, 4], f32(*range(12))), ("context_mask", "BOOL", [3], b"\x01\x01\x00"),
    ("pooled", "F32", [4], f32(1, 2, 3, 4))]))

# ---- safetensors datasets ----------------------------------------------------------------------
tf = "tensor_file"
pix = bytes(range(2 * 1 * 4 * 4))
put(tf, "nchw.safetensors", safetensors([("images", "U8", [2, 1, 4, 4], pix), ("labels", "I64", [2], i64(0, 3))]))
put(tf, "nhwc.safetensors", safetensors([("images", "U8", [2, 4, 4, 1], pix), ("labels", "U8", [2], b"\x01\x00")],
                                        {"num_classes": "5"}))
put(tf, "layout.safetensors", safetensors([("images", "U8", [1, 3, 2, 2], bytes(12))], {"layout": "NCHW"}))
put(tf, "unlabeled-rgb.safetensors", safetensors([("images", "U8", [1, 2, 2, 3], bytes(12))]))
put(tf, "negative-label.safetensors", safetensors([("images", "U8", [2, 1, 2, 2], bytes(8)), ("labels", "I32", [2], struct.pack("<2i", 1, -1))]))
put(tf, "float-images.safetensors", safetensors([("images", "F32", [1, 1, 1, 1], f32(0.5))]))

# ---- partitions --------------------------------------------------------------------------------
def partition(labels, k, extra=None, meta=None):
    sizes = [labels.count(c) for c in range(k)]
    m = {"format": "ddm-partition-1", "k": str(k), "n": str(len(labels)), "data_sha256": "0" * 64,
         "data": "fuzz", "features": "pixels:4", "settings": json.dumps({"k": k, "method": "random", "seed": 0})}
    m.update(meta or {})
    t = [("labels", "I64", [len(labels)], i64(*labels)), ("sizes", "I64", [k], i64(*sizes))]
    return safetensors(t + (extra or []), m)


pa = "partition"
put(pa, "random.safetensors", partition([0, 1, 1, 0, 1, 0], 2))
put(pa, "kmeans.safetensors", partition([0, 1, 2, 0], 3, [
    ("centroids", "F32", [3, 2], f32(*range(6))), ("fine_labels", "I64", [4], i64(0, 1, 2, 3)),
    ("fine_centroids", "F32", [4, 2], f32(*range(8)))]))
put(pa, "bad-k.safetensors", partition([0, 1], 2, meta={"k": "two"}))
put(pa, "bad-settings.safetensors", partition([0, 1], 2, meta={"settings": "{not json"}))
put(pa, "label-out-of-range.safetensors", safetensors(
    [("labels", "I64", [2], i64(0, 5)), ("sizes", "I64", [2], i64(1, 1))],
    {"format": "ddm-partition-1", "k": "2", "n": "2", "data_sha256": "", "data": "", "features": "", "settings": "{}"}))

# ---- IDX (cut from the real Fashion-MNIST: 2 images, 3 labels) ---------------------------------
ix = "idx"
with gzip.open(os.path.join(FMNIST, "t10k-images-idx3-ubyte.gz")) as f:
    head = f.read(16)
    imgs = f.read(2 * 28 * 28)
with gzip.open(os.path.join(FMNIST, "t10k-labels-idx1-ubyte.gz")) as f:
    f.read(8)
    labs = f.read(3)
images_idx = head[:4] + struct.pack(">III", 2, 28, 28) + imgs
labels_idx = struct.pack(">II", 0x801, 3) + labs
put(ix, "images-2x28x28.idx", images_idx)
put(ix, "images-2x28x28.idx.gz", gzip.compress(images_idx, mtime=0))
put(ix, "labels-3.idx", labels_idx)
put(ix, "labels-3.idx.gz", gzip.compress(labels_idx, mtime=0))
put(ix, "images-tiny.idx", struct.pack(">IIII", 0x803, 1, 2, 2) + b"\x00\x40\x80\xff")
put(ix, "images-truncated.idx", struct.pack(">IIII", 0x803, 3, 4, 4) + bytes(20))
put(ix, "labels-trailing.idx.gz", gzip.compress(labels_idx + b"\x00", mtime=0))
put(ix, "labels-truncated-gzip.idx.gz", gzip.compress(labels_idx, mtime=0)[:-6])

# ---- images ------------------------------------------------------------------------------------
im = "image"


def png(w, h, color_type, channels, bit_depth=8, interlace=0):
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    row = bytes((x * 37 + y * 11) % 256 for y in range(1) for x in range(w * channels * bit_depth // 8))
    raw = b"".join(b"\x00" + bytes((b + y) % 256 for b in row) for y in range(h))
    ihdr = struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, interlace)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


put(im, "gray.png", png(4, 3, 0, 1))
put(im, "gray-alpha.png", png(3, 3, 4, 2))
put(im, "rgb.png", png(4, 4, 2, 3))
put(im, "rgba.png", png(2, 5, 6, 4))
put(im, "gray16.png", png(3, 2, 0, 1, bit_depth=16))
put(im, "broken.png", png(4, 4, 2, 3)[:40])
put(im, "gray.pgm", b"P5\n3 2\n255\n" + bytes([0, 50, 100, 150, 200, 250]))
put(im, "rgb.ppm", b"P6\n2 2\n255\n" + bytes(range(0, 240, 20)))
put(im, "rgb.bmp", (lambda px: b"BM" + struct.pack("<IHHI", 54 + len(px), 0, 0, 54) +
                    struct.pack("<IiiHHIIiiII", 40, 2, 2, 1, 24, 0, len(px), 2835, 2835, 0, 0) + px)(
    bytes([255, 0, 0, 0, 255, 0, 0, 0]) + bytes([0, 0, 255, 9, 9, 9, 0, 0])))
put(im, "gray.tga", struct.pack("<BBBHHBHHHHBB", 0, 0, 3, 0, 0, 0, 0, 0, 2, 2, 8, 0) + bytes([1, 2, 3, 4]))
# The classic 1x1 GIF.
put(im, "dot.gif", bytes.fromhex("47494638396101000100800000000000ffffff21f90401000000002c00000000010001000002024401003b"))

# ---- TOML configs ------------------------------------------------------------------------------
cf = "config"
for name in ["quickstart.toml", "fmnist-dit.toml", "fmnist-ddpm.toml", "folder-example.toml"]:
    with open(os.path.join(REPO, "configs", name)) as f:
        put(cf, name, f.read())
put(cf, "overrides.toml", "[train]\nsteps = 10\n\0train.lr=0.01\nmodel.preset=dit-tiny\nmodel.channel_mult=[1,2,2]\n")
put(cf, "unknown-key.toml", "[train]\nstepz = 10\n")
put(cf, "wrong-type.toml", "[model]\nchannels = \"many\"\nchannel_mult = [1, 2.5]\n")
put(cf, "invalid.toml", "[train\nsteps = = 3\n")
put(cf, "router.toml", "[data]\npartition = \"parts/k4\"\nholdout = 100\n[model]\npreset = \"router-dit-tiny\"\n")

# ---- state.json (@model@ etc. stand for the sha256 of the target's files) ----------------------
sj = "state_json"
state = {"format": "ddm-checkpoint-1", "step": 7, "config": "[train]\nsteps = 10\n",
         "sha256": {"model.safetensors": "@model@", "ema.safetensors": "@ema@", "optim.safetensors": "@optim@"},
         "optimizer_step": 7, "data_cursor": {"epoch": 0, "index": 224},
         "rng": {"seed": 0, "scheme": "keyed"}, "class_names": ["a", "b"], "threads": 2}
put(sj, "valid.json", json.dumps(state, indent=2))
bad = dict(state, sha256=dict(state["sha256"], **{"ema.safetensors": "0" * 64}))
put(sj, "bad-checksum.json", json.dumps(bad))
put(sj, "wrong-format.json", json.dumps(dict(state, format="ddm-checkpoint-0")))
put(sj, "truncated.json", json.dumps(state)[:60])

# ---- islands files -----------------------------------------------------------------------------
il = "islands"
with open(os.path.join(REPO, "configs", "islands-k4.toml")) as f:
    put(il, "islands-k4.toml", f.read())
put(il, "minimal.toml", 'out = "runs/x"\nconfig = "configs/quickstart.toml"\n[partition]\npath = "parts/x"\n')
put(il, "full.toml", 'out = "o"\nconfig = "configs/quickstart.toml"\n[partition]\npath = "p"\nk = 3\n'
    'features = "feature-net"\n[experts]\nbudget = "full"\nset = ["train.steps=5"]\n'
    '[router]\npreset = "router-conv-tiny"\nholdout = 0\nset = []\n'
    '[run]\nconcurrency = 2\nretries = 0\nthreads = 1\nrouting = "topk:2"\n')
put(il, "unknown-key.toml", 'out = "o"\nconfig = "configs/quickstart.toml"\n[run]\nspeed = 3\n')
put(il, "routing-threshold.toml", 'out = "o"\nconfig = "configs/quickstart.toml"\n[partition]\npath = "p"\n'
    '[run]\nrouting = "threshold:0.05"\n')

# ---- .npy features files -----------------------------------------------------------------------
def npy(descr, shape, data, fortran=False, version=1):
    header = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, "True" if fortran else "False", shape)
    pre = 10 if version == 1 else 12
    header += " " * (63 - (pre + len(header)) % 64) + "\n"
    size = struct.pack("<H", len(header)) if version == 1 else struct.pack("<I", len(header))
    return b"\x93NUMPY" + bytes([version, 0]) + size + header.encode() + data


fe = "features"
put(fe, "f4.npy", npy("<f4", "(3, 2)", f32(*range(6))))
put(fe, "f8-v2.npy", npy("<f8", "(2, 1)", struct.pack("<2d", 0.5, -1), version=2))
put(fe, "1d.npy", npy("<f4", "(4,)", f32(1, 2, 3, 4)))
put(fe, "fortran.npy", npy("<f4", "(2, 2)", f32(1, 2, 3, 4), fortran=True))
put(fe, "int.npy", npy("<i8", "(1, 1)", i64(3)))
put(fe, "short.npy", npy("<f4", "(3, 2)", f32(1, 2)))


def npz(arrays, compression):
    """numpy.savez's layout: a zip of NAME.npy members."""
    import io
    import zipfile
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as z:
        for name, data in arrays:
            info = zipfile.ZipInfo(name + ".npy", date_time=(2026, 1, 1, 0, 0, 0))  # the same bytes each run
            info.compress_type = compression
            z.writestr(info, data)
    return out.getvalue()


def utf32(keys, width):
    return b"".join(k.ljust(width, "\0").encode("utf-32-le") for k in keys)


import zipfile  # noqa: E402
keyed = [("features", npy("<f4", "(3, 2)", f32(*range(6)))), ("keys", npy("<U2", "(3,)", utf32(["a", "b1", "c"], 2)))]
put(fe, "keyed.npz", npz(keyed, zipfile.ZIP_STORED))
put(fe, "keyed-deflated.npz", npz(keyed, zipfile.ZIP_DEFLATED))
put(fe, "bytes-keys.npz", npz([keyed[0], ("keys", npy("|S2", "(3,)", b"a\0b1c\0"))], zipfile.ZIP_STORED))
put(fe, "alone.npz", npz([("arr_0", npy("<f8", "(1, 2)", struct.pack("<2d", 1, 2)))], zipfile.ZIP_STORED))

# ---- launcher environments (fuzz_comm_env): NAME=VALUE lines ----------------------------------
de = "comm_env"
put(de, "torchrun", "RANK=1\nWORLD_SIZE=2\nLOCAL_RANK=1\nLOCAL_WORLD_SIZE=2\nMASTER_ADDR=127.0.0.1\nMASTER_PORT=29500\n"
    "TORCHELASTIC_RESTART_COUNT=1\nTORCHELASTIC_USE_AGENT_STORE=True\nTORCHELASTIC_RUN_ID=none\n")
put(de, "slurm", "SLURM_PROCID=3\nSLURM_NTASKS=8\nSLURM_LOCALID=1\nSLURM_NODEID=1\nSLURM_TASKS_PER_NODE=2(x3),2\n"
    "SLURM_JOB_NODELIST=gpu[007-010],cpu1\nSLURM_JOB_ID=123456\nSLURM_RESTART_COUNT=1\nHOSTLIST=a[01-03,7],b[2-3]c\n")
put(de, "mpi", "OMPI_COMM_WORLD_RANK=1\nOMPI_COMM_WORLD_SIZE=2\nOMPI_COMM_WORLD_LOCAL_RANK=1\n"
    "OMPI_COMM_WORLD_LOCAL_SIZE=2\n")

# ---- pipeline profiles (fuzz_pipe_profile): `ddm plan --profile` files --------------------------
pp = "pipe_profile"


def unit(name, params, scale):
    return {"name": name, "params": params, "samples": [
        {"rows": r, "forward_ms": scale * r, "input_grad_ms": scale * r, "weight_grad_ms": scale * r / 2,
         "forward_nograd_ms": scale * r, "activation_bytes": 1e4 * r, "cut_bytes": 1e3 * r} for r in (1, 4)]}


profile = {"format": "ddm pipeline profile 1", "model": "unet-tiny (unet) 1x28x28, 10 classes", "workload": "latent encoder",
           "machine": "a CPU, 1 thread", "threads": 1, "optimizer_ms_per_mparam": 3.4, "self_cond": False,
           "x_bytes_per_row": 3136,
           "units": [unit("in", 1000, 0.1), unit("enc0_0", 5000, 1.0), unit("mid0", 8000, 0.5), unit("out", 300, 0.1)],
           "tasks": [{"name": "prepare: latent encoder", "uses_weights": False, "output_bytes_per_row": 6272,
                      "cost": [{"rows": 1, "ms": 1.5}, {"rows": 4, "ms": 4.0}]}]}
text = json.dumps(profile, indent=1) + "\n"
put(pp, "valid.json", text)
put(pp, "truncated.json", text[: len(text) // 2])
put(pp, "wrong-format.json", text.replace("ddm pipeline profile 1", "something else"))
put(pp, "negative.json", text.replace('"forward_ms": 0.5', '"forward_ms": -0.5', 1))
put(pp, "self-cond.json", text.replace('"self_cond": false', '"self_cond": true'))
# A skip made by enc0_0 and read by mid0, and the units' parameter passes (profiles since 2026-11-24).
routed = json.loads(text)
routed["units"][1]["skips"] = [{"read_by": 2, "bytes_per_row": 2048}]
for u in routed["units"]:
    for x in u["samples"]:
        x["weight_pass_ms"] = x["weight_grad_ms"] * 2
put(pp, "skips.json", json.dumps(routed, indent=1) + "\n")

# ---- text (fuzz_text): the first byte picks the context; the rest is the text -------------------
put("text", "caption", "MA photo of a red star, it\u2019s &amp; caf\u00e9 \U0001F408\u200d\u2b1b <end_of_text>")
put("text", "html", "\x10&#x41;&amp;lt; &notin; &#150; <b>bold</b>\r\n\u3000\uff21\ufb01\x1b[31m")
put("text", "bert", "\x30[CLS] the photos, caf\u00e9 \u4e2d\u6587 [MASK]ing \u00ad\u0345")
put("text", "invalid", b"\x05caf\xe9 \xc0\xaf")

# ---- tokenizer files (fuzz_tokenizer_files): the first byte picks the file ----------------------
put("tokenizer_files", "vocab", b"\x00#version: 0.2\ni n\nt h\na n\n")
put("tokenizer_files", "tokenizer-json", "\x01" + json.dumps(
    {"model": {"type": "BPE", "end_of_word_suffix": "</w>", "vocab": {"a": 0, "a</w>": 1}, "merges": [["a", "b"]]},
     "added_tokens": [{"id": 0, "content": "a"}]}))
put("tokenizer_files", "merges", "\x03#version: 0.2\n! !\n")
put("tokenizer_files", "config", "\x04" + json.dumps(
    {"pad_token": {"content": "!"}, "model_max_length": 77, "bos_token": "<|startoftext|>"}))
put("tokenizer_files", "bert-json", "\x05" + json.dumps(
    {"model": {"type": "WordPiece", "vocab": {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "a": 4}},
     "normalizer": {"type": "BertNormalizer", "lowercase": True}}))
put("tokenizer_files", "vocab-txt", "\x06[PAD]\n[UNK]\n[CLS]\n[SEP]\na\n##b\n")

# ---- text encoder configs (fuzz_text_encoder_files): the first byte picks the file ---------------
put("text_encoder_files", "clip-config", "\x00" + json.dumps(
    {"model_type": "clip_text_model", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
     "intermediate_size": 16, "max_position_embeddings": 5, "vocab_size": 12, "hidden_act": "quick_gelu",
     "eos_token_id": 11}))
put("text_encoder_files", "clip-config-whole-clip", "\x00" + json.dumps(
    {"model_type": "clip", "text_config": {"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
     "intermediate_size": 16, "max_position_embeddings": 5, "vocab_size": 12}, "projection_dim": 4}))
put("text_encoder_files", "index", "\x01" + json.dumps(
    {"metadata": {"total_size": 0}, "weight_map": {
        "text_model.embeddings.token_embedding.weight": "model-00001-of-00002.safetensors",
        "text_model.final_layer_norm.weight": "model-00002-of-00002.safetensors"}}))
put("text_encoder_files", "open-clip", "\x02" + json.dumps(
    {"model_cfg": {"embed_dim": 4, "quick_gelu": True, "text_cfg": {
        "width": 8, "heads": 2, "layers": 1, "context_length": 5, "vocab_size": 12, "pool_type": "argmax"}}}))
put("text_encoder_files", "bert-config", "\x03" + json.dumps(
    {"model_type": "bert", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
     "intermediate_size": 16, "max_position_embeddings": 5, "vocab_size": 12, "layer_norm_eps": 1e-12}))
put("text_encoder_files", "modules", "\x04" + json.dumps(
    [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
     {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
     {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
put("text_encoder_files", "pooling", "\x05" + json.dumps(
    {"word_embedding_dimension": 8, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
     "pooling_mode_max_tokens": False}))
put("text_encoder_files", "st-config", "\x06" + json.dumps({"max_seq_length": 4, "do_lower_case": False}))

# ---- diffusers configs (fuzz_diffusers_configs): the first byte picks the class -------------------
put("diffusers_configs", "vae", "\x00" + json.dumps(
    {"_class_name": "AutoencoderKL", "in_channels": 3, "out_channels": 3, "latent_channels": 4,
     "block_out_channels": [8, 16], "layers_per_block": 1, "norm_num_groups": 4,
     "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2,
     "scaling_factor": 0.18215, "shift_factor": None, "latents_mean": None, "use_quant_conv": True}))
put("diffusers_configs", "unet", "\x01" + json.dumps(
    {"_class_name": "UNet2DConditionModel", "in_channels": 4, "out_channels": 4, "block_out_channels": [16, 32],
     "layers_per_block": 1, "norm_num_groups": 4, "cross_attention_dim": 8, "attention_head_dim": [2, 4],
     "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"], "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
     "use_linear_projection": True, "num_class_embeds": None, "flip_sin_to_cos": True}))

put("diffusers_configs", "controlnet", "\x04" + json.dumps(
    {"_class_name": "ControlNetModel", "in_channels": 4, "block_out_channels": [16, 32], "layers_per_block": 1,
     "norm_num_groups": 4, "cross_attention_dim": 8, "attention_head_dim": 2, "conditioning_channels": 3,
     "conditioning_embedding_out_channels": [4, 8], "controlnet_conditioning_channel_order": "bgr",
     "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"], "global_pool_conditions": False}))

put("diffusers_configs", "scheduler", "\x02" + json.dumps(
    {"_class_name": "PNDMScheduler", "num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
     "beta_schedule": "scaled_linear", "prediction_type": "epsilon", "skip_prk_steps": True, "steps_offset": 1,
     "trained_betas": None, "set_alpha_to_one": False}))

# ---- tar shards with captions (fuzz_tar_shard): .txt, img2dataset's .json, a caption not UTF-8 --
def tar_of(members):
    import io
    import tarfile
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            t.addfile(info, io.BytesIO(data))
    return out.getvalue()


put("tar_shard", "captions.tar", tar_of([
    ("a.png", b"\x89PNG"), ("a.txt", "a red star, caf\u00e9\n".encode()),
    ("b.png", b"\x89PNG"), ("b.json", b'{"caption": "a ring", "url": "http://x", "width": 4}'),
    ("c.png", b"\x89PNG"), ("c.json", b'{"text": 3, "label": 1}'),
    ("d.png", b"\x89PNG"), ("d.txt", b"caf\xe9")]))
