// Detectron2 config files given with -c (configs/COCO-InstanceSegmentation/mask_rcnn_R_101_FPN_3x.yaml
// and the like): the _BASE_ chain merged as Detectron2's merge_from_file does, over Detectron2's
// defaults for the keys imgtrain maps, each key turned into the imgtrain flag with the same
// meaning. Keys that describe the architecture are accepted where they hold what imgtrain builds
// (torchvision's R-CNN with FPN) and refused otherwise; unknown keys are refused by name.
#pragma once
#include <string>
#include <vector>

namespace YAML {
class Node;
}

namespace imgtrain::cli {

struct Detectron2Setting {
  std::string flag;   // imgtrain's long flag name
  std::string value;  // its text form, as on the command line (lists comma-separated)
  std::string key;    // the Detectron2 key it comes from ("default" when from Detectron2's defaults)
};

// A config file (imgtrain's / timm's args.yaml or Detectron2's) read as one YAML document, for both
// readers: `what` names it in the one-line UserError for a folder, an unreadable file, invalid
// YAML, more than one document (only one would be read) or a key that is not a plain name.
YAML::Node load_yaml_file(const std::string& path, const std::string& what);

// Whether a config's top level is Detectron2's (MODEL, SOLVER, INPUT, ... or _BASE_).
bool is_detectron2_config(const YAML::Node& root);

// The settings of the file at `path` (already loaded as `root`), in the order they apply; notes for
// keys that are read but change nothing in imgtrain (SOLVER.CHECKPOINT_PERIOD) go to `warnings`.
// Throws UserError naming the file and the key for anything that cannot be mapped.
std::vector<Detectron2Setting> detectron2_settings(const std::string& path, const YAML::Node& root,
                                                   std::vector<std::string>& warnings);

}  // namespace imgtrain::cli
