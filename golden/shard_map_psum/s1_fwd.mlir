module @jit_s1_fwd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<f32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, []>}, tensor<8x8xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{"data"}, {}]>}) {
    %0 = sdy.manual_computation(%arg0) in_shardings=[<@mesh, [{"data"}, {}]>] out_shardings=[<@mesh, [{}, {}]>] manual_axes={"data"} (%arg1: tensor<4x8xf32>) {
      %cst_2 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
      %8 = stablehlo.reduce(%arg1 init: %cst_2) applies stablehlo.add across dimensions = [0] : (tensor<4x8xf32>, tensor<f32>) -> tensor<8xf32>
      %9 = stablehlo.broadcast_in_dim %8, dims = [1] : (tensor<8xf32>) -> tensor<1x8xf32>
      %10 = "stablehlo.all_reduce"(%9) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>, use_global_device_ids}> ({
      ^bb0(%arg2: tensor<f32>, %arg3: tensor<f32>):
        %11 = stablehlo.add %arg2, %arg3 : tensor<f32>
        stablehlo.return %11 : tensor<f32>
      }) : (tensor<1x8xf32>) -> tensor<1x8xf32>
      sdy.return %10 : tensor<1x8xf32>
    } : (tensor<8x8xf32>) -> tensor<1x8xf32>
    %1 = stablehlo.multiply %0, %0 : tensor<1x8xf32>
    %cst = stablehlo.constant dense<2.000000e+00> : tensor<f32>
    %2 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<1x8xf32>
    %3 = stablehlo.multiply %2, %0 : tensor<1x8xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %4 = stablehlo.reduce(%1 init: %cst_0) applies stablehlo.add across dimensions = [0, 1] : (tensor<1x8xf32>, tensor<f32>) -> tensor<f32>
    %cst_1 = stablehlo.constant dense<1.000000e+00> : tensor<f32>
    %5 = stablehlo.broadcast_in_dim %cst_1, dims = [] : (tensor<f32>) -> tensor<1x8xf32>
    %6 = stablehlo.multiply %5, %3 : tensor<1x8xf32>
    %7 = sdy.manual_computation(%6) in_shardings=[<@mesh, [{}, {}]>] out_shardings=[<@mesh, [{"data"}, {}]>] manual_axes={"data"} (%arg1: tensor<1x8xf32>) {
      %cst_2 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
      %8 = stablehlo.reduce(%arg1 init: %cst_2) applies stablehlo.add across dimensions = [0] : (tensor<1x8xf32>, tensor<f32>) -> tensor<8xf32>
      %9 = stablehlo.broadcast_in_dim %8, dims = [1] : (tensor<8xf32>) -> tensor<4x8xf32>
      sdy.return %9 : tensor<4x8xf32>
    } : (tensor<1x8xf32>) -> tensor<8x8xf32>
    return %4, %7 : tensor<f32>, tensor<8x8xf32>
  }
}
