// Sharded tar datasets in WebDataset's layout (<key>.jpg / .png / ... plus <key>.cls holding the
// label as text, members of one sample next to each other) and `imgtrain pack`, which writes them
// from an ImageFolder. Shards are indexed once at open (headers only, shards in parallel); samples
// are then read by offset, so the loader's per-sample determinism, resume and rank split apply,
// while its shard-aware order (shards shuffled and dealt to ranks, samples shuffled within a
// buffer) keeps reads sequential within a shard.
#pragma once
#include "data/dataset.h"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace imgtrain::data {

// One member of a tar file: its name and where its bytes are.
struct TarMember {
  std::string name;
  uint64_t offset = 0, size = 0;
};

// Regular-file members of a ustar / GNU tar (long names included, pax headers skipped). A
// malformed header ends the listing: `error` says where (the members before it are kept).
std::vector<TarMember> list_tar(const std::string& path, std::string* error = nullptr);

// The *.tar files of a folder, sorted; empty when there are none.
std::vector<std::string> find_shards(const std::string& folder);

// A dataset over the shards of a folder. Throws UserError when nothing usable is in them.
std::shared_ptr<Dataset> open_shards(const std::string& folder, int threads = 4);

struct PackOptions {
  std::string data_dir;          // an ImageFolder root (its train / validation splits) or one split
  std::string out;               // output folder: <out>/<split>/shard-000000.tar ...
  uint64_t shard_size = 1ull << 30;
  int max_size = 0;              // > 0: re-encode (JPEG q90) images whose long side exceeds it
  bool overwrite = false;        // remove the .tar files an output folder holds first (else refused)
  std::string input_key;         // the extensions read (timm's --input-key; empty: .png, .jpg, .jpeg)
  std::function<void(const std::string&)> log;
};
struct PackResult {
  int64_t samples = 0, shards = 0, reencoded = 0, skipped = 0;
};
// Writes each split found under data_dir (train, validation, ... by timm's folder names; or
// data_dir itself when it is a split) as shards. Unreadable images are skipped and counted. An
// output folder that already holds .tar files is refused (the readers would take them as part of
// the dataset) unless `overwrite`, which removes them before anything is written.
PackResult pack_image_folder(const PackOptions& o);

}  // namespace imgtrain::data
