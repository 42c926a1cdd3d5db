// DDP_UNITY_ID: the name of a namespace of the including source's own, for the test executables
// compiled in unity batches (ddp_add_test's UNITY_BATCH, tests/CMakeLists.txt). A unity file
// includes several sources in one translation unit, where their anonymous namespaces are one
// namespace and two helpers of the same name (make_model, kSteps, ...) clash; CMake defines
// DDP_UNITY_ID to a name unique to each source before including it (UNITY_BUILD_UNIQUE_ID), and a
// source wraps what its anonymous namespace holds in it:
//
//   namespace ddp {
//   namespace {
//   namespace DDP_UNITY_ID {
//   ... helpers and TESTs ...
//   }  // namespace DDP_UNITY_ID
//   }  // namespace
//   }  // namespace ddp
//
// Compiled alone (DDP_UNITY_BUILD off, or a source left out of the batches) it is this fallback.
// A source that #defines a macro #undefs it at its end, for the same reason.
#pragma once

#ifndef DDP_UNITY_ID
#define DDP_UNITY_ID ddp_unity_none
#endif
