module @jit_s0_bwd_1 attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg2: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg3: tensor<2x16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}, %arg4: tensor<2x16x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}) -> (tensor<8x16xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<2x16x16xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {}]>}) {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [0] x [0], precision = [DEFAULT, DEFAULT] : (tensor<8x16xf32>, tensor<8x8xf32>) -> tensor<16x8xf32>
    %1 = stablehlo.transpose %0, dims = [1, 0] : (tensor<16x8xf32>) -> tensor<8x16xf32>
    %cst = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %2 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %3 = stablehlo.multiply %2, %1 : tensor<8x16xf32>
    %4 = stablehlo.subtract %arg2, %3 : tensor<8x16xf32>
    %cst_0 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %5 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<2x16x16xf32>
    %6 = stablehlo.multiply %5, %arg3 : tensor<2x16x16xf32>
    %7 = stablehlo.subtract %arg4, %6 : tensor<2x16x16xf32>
    return %4, %7 : tensor<8x16xf32>, tensor<2x16x16xf32>
  }
}
