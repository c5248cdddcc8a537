// Safe reading of torch.save files (.pth, .pth.tar, .bin): the zip format (PyTorch >= 1.6) and
// the older non-zip ("legacy") stream. The pickle inside is run by a restricted VM of our own
// that builds plain values only (None, bool, int, float, str, bytes, list, tuple, dict) plus
// tensors; the only globals it accepts are the handful torch.save uses for tensors, storages and
// OrderedDict, and argparse.Namespace (timm's `args`), and it never calls anything: any other
// global is refused with a UserError naming it. Files are untrusted input: every length, offset,
// size and stride is checked against the file before use, so a malformed file is a UserError
// naming the file and the byte offset, never a crash, hang or huge allocation.
//
// The result is a SafeTensors (tensors in file order + metadata), flattened as imgtrain's own
// checkpoints are, so the weight loaders take it unchanged:
//   - a state dict (name -> tensor): the names as they are, a leading "module." (DataParallel,
//     DDP) stripped when every name has it;
//   - timm's checkpoint {state_dict, state_dict_ema, optimizer, arch, epoch, args, metric, ...}
//     and torchvision references' {model, model_ema, optimizer, lr_scheduler, epoch, args}:
//     the model's tensors as "model.<name>", the EMA's as "ema.<name>"; arch, epoch and metric
//     (and timm's args.num_classes / in_chans / img_size / gp) as metadata strings; optimizer and
//     scheduler state is parsed and dropped (its storages are never read).
#pragma once
#include "io/safetensors.h"

#include <string>
#include <string_view>

namespace imgtrain::io {

// True for what torch.save writes: a zip ("PK\3\4"), a legacy pickle stream (0x80 then a
// protocol byte, told apart from a safetensors header whose length happens to start so) or the
// pre-0.4 tar format (refused by load_torch_save with its own message). `head`: the file's first
// bytes (512 suffice).
bool is_torch_save_data(std::string_view head);
bool is_torch_save_file(const std::string& path);

// Throws UserError naming the file (and the byte offset of a defect) for a malformed file, a
// refused global or a layout that holds no state dict.
SafeTensors load_torch_save(const std::string& path);
SafeTensors parse_torch_save(std::string_view bytes, const std::string& what);

}  // namespace imgtrain::io
