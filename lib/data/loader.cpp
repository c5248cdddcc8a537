#include "data/loader.h"

#include "core/error.h"

#include "core/log.h"
#include "core/rng.h"

#ifdef IMGTRAIN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <opencv2/imgproc.hpp>
#include <torch/torch.h>

#include <fmt/format.h>

#include <cmath>
#include <list>
#include <map>

namespace imgtrain::data {

Loader::Loader(std::shared_ptr<Dataset> ds, TransformConfig tc, LoaderOptions opt)
    : ds_(std::move(ds)), tc_(std::move(tc)), opt_(opt) {
  if (opt_.world < 1 || opt_.rank < 0 || opt_.rank >= opt_.world)
    throw std::invalid_argument("loader: rank must be in [0, world)");
  const size_t w = size_t(opt_.world), r = size_t(opt_.rank);
  size_t n = opt_.repeats > 0 ? repeat_aug_samples(int64_t(ds_->size()), opt_.repeats, opt_.world)
             : opt_.pad_shares ? (ds_->size() + w - 1) / w  // this rank's share
                               : (ds_->size() + w - 1 - r) / w;
  size_t b = size_t(opt_.batch_size);
  num_batches_ = opt_.drop_last ? n / b : (n + b - 1) / b;
  if (ds_->has_targets() && (opt_.aspect_ratio_group_factor >= 0 || opt_.two_bucket_grouping)) {
    group_ids_ = aspect_ratio_groups(*ds_, opt_.aspect_ratio_group_factor, opt_.two_bucket_grouping);
    num_batches_ = n / b;  // GroupedBatchSampler: len(sampler) // batch_size, every batch full
  }
  if (opt_.pin_memory && !torch::cuda::is_available()) opt_.pin_memory = false;
}

Loader::~Loader() { stop_workers(); }

void Loader::stop_workers() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

std::vector<int64_t> rank_slice(const std::vector<int64_t>& order, int64_t rank, int64_t world) {
  std::vector<int64_t> out;
  for (size_t i = size_t(rank); i < order.size(); i += size_t(world)) out.push_back(order[i]);
  return out;
}

std::vector<int64_t> rank_share(const std::vector<int64_t>& order, int64_t rank, int64_t world) {
  const size_t n = order.size(), w = size_t(world);
  if (n == 0) return {};
  const size_t total = (n + w - 1) / w * w;
  std::vector<int64_t> out;
  out.reserve(total / w);
  for (size_t i = size_t(rank); i < total; i += w) out.push_back(order[i % n]);  // padding wraps to the start
  return out;
}

size_t repeat_aug_samples(int64_t n, double repeats, int64_t world) {
  const auto num_samples = int64_t(std::ceil(double(n) * repeats / double(world)));
  // timm's selected_round = 256, selected_ratio = world
  const int64_t selected = n >= 256 ? int64_t(std::floor(double(n / 256 * 256) / double(world)))
                                    : int64_t(std::ceil(double(n) / double(world)));
  return size_t(std::min(selected, num_samples));
}

namespace {
// An epoch's base order: torch.randperm(n) from a generator seeded with `seed` (the samplers'
// scheme), or 0..n-1.
std::vector<int64_t> permutation(int64_t n, bool shuffle, uint64_t seed) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  if (!shuffle) {
    for (int64_t i = 0; i < n; ++i) order[size_t(i)] = i;
    return order;
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
  order.assign(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + n);
  return order;
}
}  // namespace

std::vector<int64_t> repeat_aug_share(int64_t n, int64_t epoch, bool shuffle, double repeats, int64_t rank,
                                      int64_t world) {
  const auto perm = permutation(n, shuffle, uint64_t(epoch));  // timm seeds with the epoch alone
  // Each index repeated (a fractional count repeats the first ones once more), as sample keys.
  std::vector<int64_t> keys;
  const bool integral = repeats == std::floor(repeats);
  const int64_t total = integral ? n * int64_t(repeats) : int64_t(std::ceil(repeats * double(n)));
  keys.reserve(size_t(total));
  int64_t copy = 0;
  for (int64_t i = 0; i < total; ++i) {
    const int64_t src = integral ? i / int64_t(repeats) : int64_t(std::floor(double(i) / repeats));
    copy = !keys.empty() && keys.back() % n == perm[size_t(src)] ? copy + 1 : 0;
    keys.push_back(perm[size_t(src)] + copy * n);
  }
  const int64_t num_samples = int64_t(std::ceil(double(n) * repeats / double(world)));
  const int64_t total_size = num_samples * world;
  const size_t selected = repeat_aug_samples(n, repeats, world);
  std::vector<int64_t> out;
  for (int64_t i = rank; i < total_size && out.size() < selected; i += world) out.push_back(keys[size_t(i % total)]);
  return out;
}

std::vector<int64_t> shard_order(const std::vector<size_t>& starts, uint64_t seed, int64_t epoch, int64_t rank,
                                 int64_t world, size_t buffer, size_t n) {
  const int64_t shards = int64_t(starts.size()) - 1;
  const auto p = permutation(shards, true, seed + uint64_t(epoch));
  // Enough shards: each rank reads its own (r, r + W, ...); too few: every rank reads all of them
  // and takes every W-th sample of the shuffled stream.
  const bool split_shards = shards >= world;
  std::vector<int64_t> stream;
  for (int64_t k = split_shards ? rank : 0; k < shards; k += split_shards ? world : 1)
    for (size_t i = starts[size_t(p[k])]; i < starts[size_t(p[k]) + 1]; ++i) stream.push_back(int64_t(i));
  auto rng = sample_rng(seed ^ 0x7368756666ull, uint64_t(epoch), uint64_t(split_shards ? rank : 0));
  std::vector<int64_t> buf, out;
  auto emit_random = [&] {
    const size_t j = size_t(randint(rng, 0, int64_t(buf.size()) - 1));
    out.push_back(buf[j]);
    buf[j] = buf.back();
    buf.pop_back();
  };
  for (int64_t s : stream) {  // WebDataset's shuffle: fill, then emit a random element per input
    buf.push_back(s);
    if (buf.size() >= std::max<size_t>(buffer, 1)) emit_random();
  }
  while (!buf.empty()) emit_random();
  if (!split_shards) out = rank_share(out, rank, world);
  std::vector<int64_t> sized;
  for (size_t i = 0; i < n && !out.empty(); ++i) sized.push_back(out[i % out.size()]);
  return sized;
}

std::vector<int64_t> quantize_aspect_ratios(const std::vector<double>& ratios, int64_t k) {
  std::vector<double> bins;
  if (k > 0) {
    // numpy: 2 ** linspace(-1, 1, 2k + 1); linspace's step form start + i * step, the last exact
    const int64_t n = 2 * k + 1;
    const double step = 2.0 / double(n - 1);
    for (int64_t i = 0; i < n; ++i) bins.push_back(std::pow(2.0, i == n - 1 ? 1.0 : -1.0 + double(i) * step));
  } else {
    bins = {1.0};
  }
  std::vector<int64_t> g;
  g.reserve(ratios.size());
  for (double r : ratios) g.push_back(int64_t(std::upper_bound(bins.begin(), bins.end(), r) - bins.begin()));
  return g;
}

std::vector<int64_t> aspect_ratio_groups(const Dataset& ds, int64_t k, bool two_bucket) {
  std::vector<double> ratios;
  std::vector<int64_t> g;
  for (size_t i = 0; i < ds.size(); ++i) {
    const auto s = ds.image_size(i);
    if (two_bucket) g.push_back(s.width > s.height ? 0 : 1);
    else ratios.push_back(double(s.width) / double(s.height));
  }
  return two_bucket ? g : quantize_aspect_ratios(ratios, k);
}

std::vector<int64_t> grouped_batches(const std::vector<int64_t>& order, const std::vector<int64_t>& group_ids,
                                     int64_t batch_size) {
  const size_t bs = size_t(batch_size);
  std::vector<int64_t> out;
  const size_t expected = order.size() / bs;
  out.reserve(expected * bs);
  // Python's dict order of the buffers: a group's key is (re)appended when it is first seen and
  // right after each yield (defaultdict re-creates the deleted key empty).
  std::list<int64_t> key_order;
  std::map<int64_t, std::list<int64_t>::iterator> where;
  std::map<int64_t, std::vector<int64_t>> buffer, samples;
  auto touch = [&](int64_t g) {
    if (where.count(g)) key_order.erase(where[g]);
    where[g] = key_order.insert(key_order.end(), g);
  };
  size_t made = 0;
  for (int64_t idx : order) {
    const int64_t g = group_ids.at(size_t(idx));
    if (!where.count(g)) touch(g);
    buffer[g].push_back(idx);
    samples[g].push_back(idx);
    if (buffer[g].size() == bs) {
      out.insert(out.end(), buffer[g].begin(), buffer[g].end());
      buffer[g].clear();
      touch(g);
      ++made;
    }
  }
  if (made < expected) {
    std::vector<int64_t> keys(key_order.begin(), key_order.end());
    std::stable_sort(keys.begin(), keys.end(), [&](int64_t a, int64_t b) { return buffer[a].size() > buffer[b].size(); });
    for (int64_t g : keys) {
      auto& buf = buffer[g];
      const auto& src = samples[g];
      for (size_t j = 0; buf.size() < bs; ++j) buf.push_back(src[j % src.size()]);
      out.insert(out.end(), buf.begin(), buf.end());
      if (++made == expected) break;
    }
  }
  return out;
}

void Loader::start_epoch(int64_t epoch, size_t first_batch) {
  stop_workers();
  epoch_ = epoch;
  const int64_t n = int64_t(ds_->size());
  const auto starts = ds_->shard_starts();
  if (opt_.repeats > 0) {
    order_ = repeat_aug_share(n, epoch, opt_.shuffle, opt_.repeats, opt_.rank, opt_.world);
  } else if (opt_.shuffle && starts.size() > 1) {
    order_ = shard_order(starts, opt_.seed, epoch, opt_.rank, opt_.world, size_t(opt_.shuffle_buffer),
                         (ds_->size() + size_t(opt_.world) - 1) / size_t(opt_.world));
  } else {
    // torch.utils.data.DistributedSampler: g.manual_seed(seed + epoch); randperm(n, generator=g)
    order_ = permutation(n, opt_.shuffle, opt_.seed + uint64_t(epoch));
    if (opt_.world > 1) order_ = opt_.pad_shares ? rank_share(order_, opt_.rank, opt_.world)
                                                 : rank_slice(order_, opt_.rank, opt_.world);
  }
  if (!group_ids_.empty()) order_ = grouped_batches(order_, group_ids_, opt_.batch_size);
  next_batch_ = std::min(first_batch, num_batches_);
  next_to_make_ = next_batch_;
  {
    std::lock_guard<std::mutex> lk(warn_mu_);
    skipped_epoch_.clear();
  }
  ready_.clear();
  worker_error_.reset();
  worker_user_error_ = false;
  stopping_ = false;
  for (int64_t t = 0; t < opt_.workers; ++t) threads_.emplace_back([this] { worker_loop(); });
}

void Loader::worker_loop() {
#ifdef IMGTRAIN_WITH_CUDA
  if (opt_.pin_memory && opt_.cuda_device >= 0) c10::cuda::set_device(c10::DeviceIndex(opt_.cuda_device));
#endif
  const size_t window = size_t(std::max<int64_t>(1, opt_.workers * opt_.prefetch_per_worker));
  for (;;) {
    size_t b;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_work_.wait(lk, [&] { return stopping_ || (next_to_make_ < num_batches_ && next_to_make_ < next_batch_ + window); });
      if (stopping_) return;
      b = next_to_make_++;
    }
    Batch batch;
    std::optional<std::string> err;
    bool user = false;
    try {
      batch = make_batch(b);
    } catch (const UserError& e) {
      err = e.what();
      user = true;
    } catch (const std::exception& e) {
      err = e.what();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (err && !worker_error_) worker_error_ = err, worker_user_error_ = user;
      ready_[b] = std::move(batch);
    }
    cv_done_.notify_all();
  }
}

int64_t Loader::skipped_this_epoch() const {
  std::lock_guard<std::mutex> lk(warn_mu_);
  return int64_t(skipped_epoch_.size());
}

std::optional<size_t> Loader::load_sample(size_t key, const std::function<void(size_t, std::mt19937_64&)>& load) {
  size_t idx = key % ds_->size();
  // a split smaller than the limit is unreadable as a whole once every image has been tried
  const size_t give_up = std::min<size_t>(kMaxConsecutiveUnreadable, ds_->size());
  for (int attempt = 0;; ++attempt) {
    // the first try draws from (seed, epoch, key): the same augmentation as without refilling
    auto rng = sample_rng(opt_.seed, uint64_t(epoch_), key + size_t(attempt) * 0x9E3779B97F4A7C15ull);
    try {
      load(idx, rng);
      return idx;
    } catch (const DecodeError& e) {
      // every message names the file (a transform's, e.g. a resize above the pixel limit, does not)
      std::string why = e.what();
      if (const std::string name = ds_->describe(idx); why.find(name) == std::string::npos)
        why = fmt::format("'{}': {}", name, why);
      {
        std::lock_guard<std::mutex> lk(warn_mu_);
        if (warned_.insert(idx).second) log::warn("skipping unreadable image: {}", why);
        skipped_epoch_.insert(idx);
      }
      if (!opt_.refill_unreadable) return std::nullopt;
      if (size_t(attempt) + 1 >= give_up)
        throw UserError(give_up == ds_->size()
                            ? fmt::format("all {} images are unreadable (the last: {}); is the data readable?",
                                          give_up, why)
                            : fmt::format("{} unreadable images in a row (the last: {}); is the data readable?",
                                          give_up, why));
      idx = (idx + 1) % ds_->size();  // timm: the next index takes its place
    }
  }
}

Batch Loader::make_batch(size_t b) {
  const size_t bs = size_t(opt_.batch_size);
  const size_t begin = b * bs, end = std::min(order_.size(), begin + bs);
  if (ds_->has_targets()) return make_detection_batch(begin, end);
  const int64_t count = int64_t(end - begin);
  auto opts = at::TensorOptions().dtype(at::kByte).pinned_memory(opt_.pin_memory);
  Batch out;
  out.images = at::empty({count, tc_.size, tc_.size, tc_.channels}, opts);
  out.labels = at::empty({count}, at::TensorOptions().dtype(at::kLong));
  out.indices = at::empty({count}, at::TensorOptions().dtype(at::kLong));
  auto* dst = out.images.data_ptr<uint8_t>();
  auto* lab = out.labels.data_ptr<int64_t>();
  auto* ids = out.indices.data_ptr<int64_t>();
  const size_t row = size_t(tc_.size) * tc_.size * tc_.channels;
  int64_t filled = 0;
  for (size_t k = begin; k < end; ++k) {
    // Order entries are sample keys: the dataset index, plus copy * N for a repeated copy
    // (--aug-repeats), so every copy draws its own augmentation.
    const size_t key = size_t(order_[k]);
    cv::Mat img;
    const auto idx = load_sample(key, [&](size_t i, std::mt19937_64& rng) {
      std::string bytes;
      img = ds_->encoded(i, bytes) ? apply_transform_encoded(bytes, tc_, rng, ds_->describe(i))
                                   : apply_transform(ds_->image(i), tc_, rng);
    });
    if (!idx) continue;
    std::memcpy(dst + size_t(filled) * row, img.data, row);
    ids[filled] = int64_t(key);
    lab[filled++] = ds_->label(*idx);
  }
  if (filled < count) {
    out.images = out.images.narrow(0, 0, filled);
    out.labels = out.labels.narrow(0, 0, filled);
    out.indices = out.indices.narrow(0, 0, filled);
  }
  return out;
}

Batch Loader::make_detection_batch(size_t begin, size_t end) {
  Batch out;
  std::vector<cv::Mat> images;
  std::vector<int64_t> ids;
  for (size_t k = begin; k < end; ++k) {
    cv::Mat img;
    BoxTarget t;
    const auto idx = load_sample(size_t(order_[k]), [&](size_t i, std::mt19937_64& rng) {
      std::string bytes;
      ds_->encoded(i, bytes);
      img = decode_image(bytes, ds_->describe(i));  // the whole image: the model resizes it
      if (img.channels() == 1 && tc_.channels == 3) cv::cvtColor(img, img, cv::COLOR_GRAY2RGB);  // PIL's convert("RGB")
      // the target fits the decoded image, as torchvision's; annotations that give another size
      // (edited by hand, or the image replaced) are warned once per image
      if (const auto said = ds_->image_size(i); said.width > 0 && said != img.size()) {
        std::lock_guard<std::mutex> lk(warn_mu_);
        if (size_warned_.insert(i).second)
          log::warn("'{}': the image is {}x{} but its annotations say {}x{}; boxes are clamped to and masks drawn at "
                    "the image's size",
                    ds_->describe(i), img.cols, img.rows, said.width, said.height);
      }
      t = ds_->target(i, img.size());
      if (tc_.train && !tc_.no_aug) {
        if (tc_.lsj_size > 0) {  // ScaleJitter, FixedSizeCrop (fill: the references' mean 123, 117, 104)
          const double lo = tc_.lsj_scale[0], hi = tc_.lsj_scale[1];
          const float scale = float(lo) + float(uniform01(rng)) * float(hi - lo);  // torch.rand's float32
          const float crop = float(uniform01(rng));
          scale_jitter_crop(img, t, tc_.lsj_size, scale, crop, cv::Scalar(123, 117, 104));
        }
        random_hflip(img, t, tc_.hflip, rng);
      }
      // GeneralizedRCNNTransform's torch_choice of the training min size, drawn here per sample
      if (!tc_.min_sizes.empty())
        t.min_size = tc_.train && tc_.min_sizes.size() > 1
                         ? tc_.min_sizes[size_t(randint(rng, 0, int64_t(tc_.min_sizes.size()) - 1))]
                         : tc_.min_sizes.back();
    });
    if (!idx) continue;
    images.push_back(std::move(img));
    out.targets.push_back(std::move(t));
    ids.push_back(int64_t(*idx));
  }
  auto padded = pad_collate(images, 32);
  out.images = opt_.pin_memory ? padded.images.pin_memory() : padded.images;
  out.sizes = padded.sizes;
  out.indices = torch::tensor(ids, torch::kLong);
  out.labels = torch::empty({0}, torch::kLong);
  return out;
}

std::optional<Batch> Loader::next() {
  if (next_batch_ >= num_batches_) return std::nullopt;
  Batch b;
  if (threads_.empty()) {
    b = make_batch(next_batch_);
  } else {
    std::unique_lock<std::mutex> lk(mu_);
    cv_done_.wait(lk, [&] { return ready_.count(next_batch_) > 0; });
    if (worker_error_) {
      if (worker_user_error_) throw UserError(*worker_error_);
      throw std::runtime_error("data loader: " + *worker_error_);
    }
    b = std::move(ready_[next_batch_]);
    ready_.erase(next_batch_);
    ++next_batch_;
    lk.unlock();
    cv_work_.notify_all();
    return b;
  }
  ++next_batch_;
  return b;
}

}  // namespace imgtrain::data
