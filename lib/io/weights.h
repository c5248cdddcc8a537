// Model weights by timm's state-dict names: reading them out of a model, loading them in with
// exact name/shape checks, timm-style pretrained loading (classifier reset, first-conv channel
// adaptation), the offline Hugging Face hub cache lookup, and plain state-dict export.
#pragma once
#include "core/error.h"
#include "io/safetensors.h"

#include <torch/nn/module.h>

#include <set>
#include <string>
#include <utility>
#include <vector>

namespace imgtrain::io {

// A weights file a user names (--pretrained-path, --initial-checkpoint, validate --checkpoint,
// export): told apart by its content, not its name. A torch.save file (.pth, .pth.tar, .bin) is
// read by the restricted unpickler of io/torch_pickle.h; anything else must be safetensors.
SafeTensors load_weights_file(const std::string& path);

// Parameters and buffers under their module paths: timm's state dict.
std::vector<std::pair<std::string, at::Tensor>> state_dict(const torch::nn::Module& m);

// False when a floating-point tensor holds a NaN or an infinity (weights that would only surface
// later as "training diverged"); other dtypes are always finite.
bool all_finite(const at::Tensor& t);

// load_state_dict's refusal of weights whose names or shapes do not fit the model, with the names
// it lists (for a caller that can say which of its flags built another model).
struct WeightsMismatch : UserError {
  WeightsMismatch(const std::string& msg, std::vector<std::string> missing_, std::vector<std::string> unexpected_,
                  std::vector<std::string> wrong_shape_)
      : UserError(msg), missing(std::move(missing_)), unexpected(std::move(unexpected_)),
        wrong_shape(std::move(wrong_shape_)) {}
  std::vector<std::string> missing, unexpected, wrong_shape;  // parameter and buffer names
};

// Copies tensors named `prefix + key` into the module; every key must match by name and shape
// (except model keys in `keep`, which keep their values), otherwise a WeightsMismatch lists what
// is missing, unexpected or of the wrong shape.
void load_state_dict(torch::nn::Module& m, const SafeTensors& st, const std::string& prefix, const std::string& what,
                     const std::set<std::string>& keep = {});

// The weights of a checkpoint or plain state-dict file: "ema." if present and preferred, else
// "model.", else unprefixed keys.
std::string weights_prefix(const SafeTensors& st, bool prefer_ema);

struct PretrainedSpec {
  std::string first_conv = "conv1";  // module path of the stem convolution
  std::string classifier = "fc";     // module path of the classifier
};

// timm's load_pretrained for a file of (possibly different-shaped) weights: a classifier whose
// class count differs from the model's is left at the model's initialisation; a first conv with
// 3 input channels is adapted to the model's (summed for 1 channel, else repeated and scaled by
// 3 / in_chans), as timm's adapt_input_conv does. Returns a note of what was adapted ("" if none).
std::string load_pretrained(torch::nn::Module& m, const SafeTensors& st, const PretrainedSpec& spec,
                            const std::string& what);
at::Tensor adapt_input_conv(int64_t in_chans, const at::Tensor& weight);
// timm's resample_abs_pos_embed: a 1 x (prefix + h*w) x C position embedding on a square grid
// resized to new_h x new_w by antialiased bicubic interpolation (in float32), prefix tokens kept.
// load_pretrained applies it to `pos_embed` when the model's grid differs from the file's.
at::Tensor resample_abs_pos_embed(const at::Tensor& posemb, int64_t new_h, int64_t new_w, int64_t num_prefix_tokens);

// Offline Hugging Face hub cache: <cache>/models--timm--<model>.<tag>/snapshots/<rev>/model.safetensors,
// with <cache> from HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub, and <rev>
// from refs/main when present. Throws UserError naming every place it looked.
std::string find_hub_weights(const std::string& model, const std::string& tag);

}  // namespace imgtrain::io
