module @jit_s0_fwd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<16x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}) -> (tensor<4x8xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4x8xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4x8xf32> {jax.result_info = "result[2]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<4x8xf32> {jax.result_info = "result[3]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<8x16xf32> {jax.result_info = "result[4]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<16xf32> {jax.result_info = "result[5]", sdy.sharding = #sdy.sharding<@mesh, [{}]>}, tensor<16x16xf32> {jax.result_info = "result[6]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<16xf32> {jax.result_info = "result[7]", sdy.sharding = #sdy.sharding<@mesh, [{}]>}) {
    %0 = stablehlo.reshape %arg0 : (tensor<16x8xf32>) -> tensor<4x4x8xf32>
    %1 = stablehlo.slice %0 [0:1, 0:4, 0:8] : (tensor<4x4x8xf32>) -> tensor<1x4x8xf32>
    %2 = stablehlo.reshape %1 : (tensor<1x4x8xf32>) -> tensor<4x8xf32>
    %3 = stablehlo.slice %0 [1:2, 0:4, 0:8] : (tensor<4x4x8xf32>) -> tensor<1x4x8xf32>
    %4 = stablehlo.reshape %3 : (tensor<1x4x8xf32>) -> tensor<4x8xf32>
    %5 = stablehlo.slice %0 [2:3, 0:4, 0:8] : (tensor<4x4x8xf32>) -> tensor<1x4x8xf32>
    %6 = stablehlo.reshape %5 : (tensor<1x4x8xf32>) -> tensor<4x8xf32>
    %7 = stablehlo.slice %0 [3:4, 0:4, 0:8] : (tensor<4x4x8xf32>) -> tensor<1x4x8xf32>
    %8 = stablehlo.reshape %7 : (tensor<1x4x8xf32>) -> tensor<4x8xf32>
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %9 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<1x8x16xf32>
    %10 = stablehlo.reshape %9 : (tensor<1x8x16xf32>) -> tensor<8x16xf32>
    %cst_0 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %11 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<1x16xf32>
    %12 = stablehlo.reshape %11 : (tensor<1x16xf32>) -> tensor<16xf32>
    %cst_1 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %13 = stablehlo.broadcast_in_dim %cst_1, dims = [] : (tensor<f32>) -> tensor<1x16x16xf32>
    %14 = stablehlo.reshape %13 : (tensor<1x16x16xf32>) -> tensor<16x16xf32>
    %cst_2 = stablehlo.constant dense<0.000000e+00> : tensor<f32>
    %15 = stablehlo.broadcast_in_dim %cst_2, dims = [] : (tensor<f32>) -> tensor<1x16xf32>
    %16 = stablehlo.reshape %15 : (tensor<1x16xf32>) -> tensor<16xf32>
    return %2, %4, %6, %8, %10, %12, %14, %16 : tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<4x8xf32>, tensor<8x16xf32>, tensor<16xf32>, tensor<16x16xf32>, tensor<16xf32>
  }
}
