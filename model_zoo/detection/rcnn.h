// Faster R-CNN and Mask R-CNN as torchvision builds them (torchvision/models/detection): a zoo
// classifier's trunk as the FPN body, the FeaturePyramidNetwork with its max-pool level, the
// RegionProposalNetwork (anchors, box coder, matcher, balanced sampler, proposal filtering) and
// the RoIHeads (MultiScaleRoIAlign, the two-MLP or conv box head, the mask head), with
// torchvision's module names, so named_parameters() is torchvision's state dict, and its numbers
// (RCNNOptions' defaults). The image transform (normalise, resize, pad) is done by the caller
// (the detection task, with data::detection_resize / batch_images): forward takes the batched
// tensor and each image's resized size, as torchvision's model does after its transform.
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace imgtrain::io {
struct SafeTensors;
}

namespace imgtrain::model_zoo::detection {

struct RCNNOptions {
  int64_t num_classes = 91;  // including the background, as torchvision's
  // Backbone layers trained (torchvision's trainable_backbone_layers: 0..5 counted from layer4
  // down to conv1); -1 = torchvision's rule: 3 when starting from weights, else all (5).
  int64_t trainable_backbone_layers = -1;
  bool from_weights = false;  // the backbone starts from weights: FrozenBatchNorm2d, 3 trainable layers
  double frozen_bn_eps = 1e-5;
  // RegionProposalNetwork
  int64_t rpn_pre_nms_top_n_train = 2000, rpn_pre_nms_top_n_test = 1000;
  int64_t rpn_post_nms_top_n_train = 2000, rpn_post_nms_top_n_test = 1000;
  double rpn_nms_thresh = 0.7, rpn_fg_iou_thresh = 0.7, rpn_bg_iou_thresh = 0.3;
  int64_t rpn_batch_size_per_image = 256;
  double rpn_positive_fraction = 0.5, rpn_score_thresh = 0.0;
  // RoIHeads
  double box_score_thresh = 0.05, box_nms_thresh = 0.5;
  int64_t box_detections_per_img = 100;
  double box_fg_iou_thresh = 0.5, box_bg_iou_thresh = 0.5;
  int64_t box_batch_size_per_image = 512;
  double box_positive_fraction = 0.25;
  std::array<double, 4> bbox_reg_weights{10.0, 10.0, 5.0, 5.0};
  // MultiScaleRoIAlign: torchvision's sampling 2 with aligned=False; Detectron2's ROIAlignV2 is
  // aligned=True with sampling_ratio 0 (adaptive).
  int64_t box_sampling_ratio = 2, mask_sampling_ratio = 2;
  // Training: positive RoIs per image the mask head runs on (0: every positive, torchvision's).
  int64_t mask_rois_per_image = 0;
  bool roi_aligned = false;
  // How a mask's 28x28 grid maps onto its box, in training targets and in pasting.
  // kTorchvision: targets roi_align(aligned=False) of the gt mask (fractions), paste_masks_in_image
  //   (one-pixel padding, int64 boxes, prob > threshold): half a pixel apart from each other.
  // kDetectron2: targets roi_align(aligned=True, adaptive sampling) binarised at 0.5
  //   (BitMasks.crop_and_resize), pasted by grid_sample at pixel centres within the float box
  //   (detectron2.layers.paste_masks_in_image, prob >= threshold).
  // kAligned: Detectron2's aligned targets kept as fractions (as torchvision keeps them) and its paste.
  enum class MaskConvention { kTorchvision, kDetectron2, kAligned };
  MaskConvention mask_convention = MaskConvention::kTorchvision;
  // LevelMapper's canonical box size (level 4 for a box of this side; torchvision's 224).
  double roi_canonical_size = 224;
  // "smooth_l1" (torchvision, beta 1/9) or "l1" (Detectron2's default box regression loss).
  std::string box_loss = "smooth_l1";
  std::string rpn_box_loss = "smooth_l1";  // the RPN's: torchvision's smooth-L1 (beta 1/9) or L1 (Detectron2)
  // Widths (torchvision's module arguments; Detectron2's MODEL.FPN.OUT_CHANNELS,
  // MODEL.ROI_BOX_HEAD.FC_DIM, MODEL.ROI_MASK_HEAD.CONV_DIM / NUM_CONV): the FPN's output channels
  // (also the RPN head's and the RoI features'), the box head's representation size (TwoMLPHead, or
  // the v2 head's Linear), the mask head's convolution channels (and the predictor's transposed
  // convolution) and its number of convolutions. torchvision's builders use 256 / 1024 / 256 / 4.
  int64_t fpn_channels = 256, box_head_dim = 1024, mask_head_dim = 256, mask_head_convs = 4;
  // Tests: the balanced samplers take the first candidates instead of a random permutation.
  bool deterministic_sampling = false;
};

// The builder's keyword defaults that differ between models (torchvision's
// fasterrcnn_mobilenet_v3_large_320_fpn: min_size 320, max_size 640, 150 RPN proposals in
// evaluation, rpn_score_thresh 0.05); a flag the user gives replaces them.
struct RCNNDefaults {
  double min_size = 800, max_size = 1333;
  int64_t rpn_pre_nms_top_n_test = 1000, rpn_post_nms_top_n_test = 1000;
  double rpn_score_thresh = 0.0;
};

struct ImageBatch {
  at::Tensor tensors;                          // float [B, C, H, W], normalised, padded
  std::vector<std::array<int64_t, 2>> sizes;   // each image's (h, w) before padding
};

// One image's training target at the model's input size.
struct Target {
  at::Tensor boxes;   // float [N, 4] x1y1x2y2
  at::Tensor labels;  // int64 [N]
  at::Tensor masks;   // uint8 [N, H, W] (Mask R-CNN), undefined otherwise
};

struct Detections {
  at::Tensor boxes, scores, labels;
  at::Tensor masks;  // float [N, 1, 28, 28] probabilities (after postprocess: [N, 1, H, W] pasted)
};

struct RCNNResult {
  std::vector<std::pair<std::string, at::Tensor>> losses;  // training: torchvision's loss dict order
  std::vector<Detections> detections;                      // evaluation
};

class GeneralizedRCNNImpl : public torch::nn::Module {
 public:
  // arch: one of the registered names (fasterrcnn_resnet50_fpn, maskrcnn_resnet50_fpn_v2, ...).
  GeneralizedRCNNImpl(const std::string& arch, RCNNOptions o);
  // Training (is_training(), targets given): the loss dict; evaluation: detections in the
  // resized images' pixels (postprocess maps them back).
  RCNNResult forward(const ImageBatch& images, const std::vector<Target>* targets = nullptr);
  bool has_mask() const { return mask_; }
  const RCNNOptions& options() const { return o_; }
  const std::string& arch() const { return arch_; }
  // The balanced samplers' draws (torch.randperm in torchvision) come from this generator when
  // set, so a step's sampling is reproducible from its seed; the global one otherwise.
  std::optional<at::Generator> generator;

  struct Impl;
  std::shared_ptr<Impl> impl;

 private:
  std::string arch_;
  RCNNOptions o_;
  bool mask_ = false;
  bool mobilenet_ = false;
};
TORCH_MODULE(GeneralizedRCNN);

// torchvision's GeneralizedRCNNTransform.postprocess for one image: boxes scaled from the resized
// size back to the original one (float32 ratios), masks pasted into the original image by the
// convention's paste (torchvision's paste_masks_in_image with its one-pixel padding and int64
// boxes; Detectron2's grid_sample at pixel centres). With `threshold` > 0 the pasted masks come
// back as uint8 (prob > threshold; Detectron2's prob >= threshold), which saves 4x the memory of
// the floats.
void postprocess(Detections& d, std::array<int64_t, 2> resized, std::array<int64_t, 2> original,
                 double threshold = 0.0,
                 RCNNOptions::MaskConvention convention = RCNNOptions::MaskConvention::kTorchvision);
// "torchvision" / "detectron2" / "aligned" (the --mask-convention values), and back.
RCNNOptions::MaskConvention parse_mask_convention(const std::string& s);
const char* mask_convention_name(RCNNOptions::MaskConvention c);

// The names registered (torchvision's builders), and a model by name.
const std::vector<std::string>& rcnn_names();
bool rcnn_has_mask(const std::string& arch);
RCNNDefaults rcnn_defaults(const std::string& arch);
GeneralizedRCNN create_rcnn(const std::string& arch, const RCNNOptions& o);
// Weights into a detector from the tensors of a file under `prefix` (a checkpoint's model or EMA): a whole detector
// (torchvision's, with or without BN counters; predictors of another class count keep their
// initialisation) or a classifier's state dict for the body. `what` names the source in errors;
// returns the line to log.
std::string load_rcnn_weights(GeneralizedRCNNImpl& m, const io::SafeTensors& file, const std::string& prefix,
                              const std::string& what, const std::string& source);

// Pieces with torchvision's numbers, public for the tests.
// BoxCoder.encode_single / decode_single (bbox_xform_clip log(1000/16)).
at::Tensor encode_boxes(const at::Tensor& reference, const at::Tensor& proposals, const std::array<double, 4>& w);
at::Tensor decode_boxes(const at::Tensor& rel_codes, const at::Tensor& boxes, const std::array<double, 4>& w);
// Matcher: per column, the best row's index, -1 below `low`, -2 between (low quality matches
// restored when asked).
at::Tensor match(const at::Tensor& quality, double high, double low, bool allow_low_quality);
// AnchorGenerator for one feature map: `sizes` x `ratios` cell anchors tiled with `stride`.
at::Tensor grid_anchors(int64_t grid_h, int64_t grid_w, int64_t stride_h, int64_t stride_w,
                        const std::vector<double>& sizes, const std::vector<double>& ratios);

}  // namespace imgtrain::model_zoo::detection
