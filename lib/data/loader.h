// A multi-threaded loader: -j threads decode and augment whole batches ahead of the consumer,
// delivered in order. Batches are uint8 NHWC; normalisation happens on the training device.
// Each sample's augmentation randomness comes from (seed, epoch, index), so batches are the same
// for any thread count. Unreadable images are skipped, warned once by name and counted.
// Datasets with targets (detection) give pad-collated batches of whole images at their own size
// (flipped with their boxes and masks, each with its drawn resize target), grouped by aspect ratio.
#pragma once
#include "data/dataset.h"
#include "data/target.h"
#include "data/transforms.h"

#include <ATen/core/Tensor.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

namespace imgtrain::data {

// One batch. Classification stacks fixed-size images and carries class indices; tasks with
// variable-size images and structured targets (detection) carry a pad-collated batch with each
// image's size and one target per image (data/target.h).
struct Batch {
  at::Tensor images;  // uint8 [B, H, W, C]
  at::Tensor labels;  // int64 [B]: class indices (classification)
  at::Tensor indices;  // int64 [B]: dataset index of each sample (per-sample randomness after the loader)
  at::Tensor sizes;    // int64 [B, 2]: (height, width) before padding; undefined for stacked batches
  std::vector<BoxTarget> targets;  // per image (detection); empty for classification
};

struct LoaderOptions {
  int64_t batch_size = 128;
  bool shuffle = false;
  bool drop_last = false;
  int64_t workers = 4;
  uint64_t seed = 42;
  bool pin_memory = false;
  // With pin_memory: the CUDA device the batches go to, made current in every loader thread so
  // pinned allocations do not open a context on device 0; -1: none.
  int64_t cuda_device = -1;
  int64_t prefetch_per_worker = 2;
  // Data-parallel share: this rank's part of every epoch's order (rank r of world W).
  int64_t rank = 0, world = 1;
  // --aug-repeats: timm's RepeatAugSampler (each sample `repeats` times per epoch, copies spread
  // over ranks, about N / world samples per rank); 0 = off.
  double repeats = 0;
  // Sharded datasets, shuffled: shards are permuted (seed + epoch) and dealt to ranks, and samples
  // pass through a shuffle buffer of this size, so reads stay sequential within a shard.
  int64_t shuffle_buffer = 2048;
  // Datasets with targets (detection): torchvision's GroupedBatchSampler over this rank's share
  // with aspect-ratio groups of factor k (--aspect-ratio-group-factor; < 0 = plain batches), or
  // Detectron2's two buckets (landscape / the rest).
  int64_t aspect_ratio_group_factor = -1;
  bool two_bucket_grouping = false;
  // DistributedSampler's padding (every rank the same count, the order's start repeated). Off for
  // sharded evaluation: rank r takes r, r + W, ... and no image is seen twice.
  bool pad_shares = true;
  // Training: an unreadable image is replaced by the next dataset index (timm's ImageDataset
  // retry), so batches stay full; after kMaxConsecutiveUnreadable failures in a row the loader
  // stops with an error naming the last file (a split that is unreadable as a whole). Off: the
  // sample is dropped from its batch (evaluation counts each image once).
  bool refill_unreadable = false;
};
inline constexpr int kMaxConsecutiveUnreadable = 50;  // timm's _ERROR_RETRY

// The shard-aware training order of rank r of W (see LoaderOptions::shuffle_buffer), `n` samples
// long (wrapped or cut so that every rank has the same number of batches).
std::vector<int64_t> shard_order(const std::vector<size_t>& starts, uint64_t seed, int64_t epoch, int64_t rank,
                                 int64_t world, size_t buffer, size_t n);

// Rank r's positions r, r + W, ... of `order`, no padding (ranks may differ by one sample).
std::vector<int64_t> rank_slice(const std::vector<int64_t>& order, int64_t rank, int64_t world);

// torch's DistributedSampler split of an epoch's order: padded by repeating its start to a
// multiple of `world`, then rank r takes positions r, r + W, ... (with an unshuffled order this
// is timm's OrderedDistributedSampler: N = 10, W = 4 gives [0 4 8] [1 5 9] [2 6 0] [3 7 1]).
std::vector<int64_t> rank_share(const std::vector<int64_t>& order, int64_t rank, int64_t world);

// timm's RepeatAugSampler for rank r of W: sample keys (index + copy * n, so each copy gets its
// own augmentation draw) and the per-rank length (selected_round 256).
std::vector<int64_t> repeat_aug_share(int64_t n, int64_t epoch, bool shuffle, double repeats, int64_t rank,
                                      int64_t world);
size_t repeat_aug_samples(int64_t n, double repeats, int64_t world);

// Aspect-ratio groups of a dataset's images (width / height), torchvision's
// create_aspect_ratio_groups: k > 0 -> bins 2^linspace(-1, 1, 2k + 1), k = 0 -> [1.0], each ratio
// quantised by bisect_right over the bins (2k + 2 groups). Detectron2's two buckets
// (AspectRatioGroupedDataset: width > height -> 0, else 1) with `two_bucket`.
std::vector<int64_t> aspect_ratio_groups(const Dataset& ds, int64_t k, bool two_bucket = false);
std::vector<int64_t> quantize_aspect_ratios(const std::vector<double>& ratios, int64_t k);

// torchvision's GroupedBatchSampler over one rank's `order`: batches of `batch_size` indices of
// one group, yielded as each group's buffer fills, in the order of the stream; then, to make
// len(order) / batch_size batches, the unfinished buffers (the fullest first, ties in the order
// the buffers were opened) are completed with their group's first samples (repeated when the
// group is smaller than a batch). Returns the batches concatenated.
std::vector<int64_t> grouped_batches(const std::vector<int64_t>& order, const std::vector<int64_t>& group_ids,
                                     int64_t batch_size);

class Loader {
 public:
  Loader(std::shared_ptr<Dataset> ds, TransformConfig tc, LoaderOptions opt);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // Fixes the epoch's sample order (torch's randperm seeded with seed + epoch when shuffling);
  // `first_batch` > 0 starts the epoch there (resuming mid-epoch) without loading what precedes.
  void start_epoch(int64_t epoch, size_t first_batch = 0);
  // The next batch of this epoch in order, or nullopt at the end.
  std::optional<Batch> next();
  size_t num_batches() const { return num_batches_; }
  const Dataset& dataset() const { return *ds_; }
  // The distinct unreadable images met so far this epoch (an image tried twice, once for its own
  // sample and once in another's place, counts once).
  int64_t skipped_this_epoch() const;
  const std::vector<int64_t>& order() const { return order_; }

 private:
  Batch make_batch(size_t b);
  Batch make_detection_batch(size_t begin, size_t end);
  // Runs load(index, generator) for sample `key`. An unreadable image (DecodeError) is warned once
  // and counted in the epoch's set; with refill_unreadable the next index takes its place. Returns
  // the index used, or nullopt when the sample is dropped.
  std::optional<size_t> load_sample(size_t key, const std::function<void(size_t, std::mt19937_64&)>& load);
  void stop_workers();
  void worker_loop();

  std::shared_ptr<Dataset> ds_;
  TransformConfig tc_;
  LoaderOptions opt_;
  size_t num_batches_ = 0;
  int64_t epoch_ = 0;
  std::vector<int64_t> order_;
  std::vector<int64_t> group_ids_;  // aspect-ratio group of each sample (grouped batching only)
  size_t next_batch_ = 0;  // consumer position

  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  std::map<size_t, Batch> ready_;
  std::optional<std::string> worker_error_;
  bool worker_user_error_ = false;  // the data's fault (UserError), reported as such
  size_t next_to_make_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
  mutable std::mutex warn_mu_;
  std::set<size_t> warned_;        // warned by name once per loader
  std::set<size_t> size_warned_;   // detection images whose annotations give another size, warned once
  std::set<size_t> skipped_epoch_;  // unreadable this epoch
};

}  // namespace imgtrain::data
