module @jit_s0_bwd attributes {mhlo.num_partitions = 2 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["data"=2]> {stablehlo.mesh = {axes = [{name = "data", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg1: tensor<16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}, %arg2: tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, %arg3: tensor<16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{}]>}) -> (tensor<8x16xf32> {jax.result_info = "result[0]", sdy.sharding = #sdy.sharding<@mesh, [{}, {}]>}, tensor<16xf32> {jax.result_info = "result[1]", sdy.sharding = #sdy.sharding<@mesh, [{}]>}) {
    %cst = stablehlo.constant dense<4.000000e+00> : tensor<f32>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %1 = stablehlo.divide %arg0, %0 : tensor<8x16xf32>
    %cst_0 = stablehlo.constant dense<4.000000e+00> : tensor<f32>
    %2 = stablehlo.broadcast_in_dim %cst_0, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %3 = stablehlo.divide %arg1, %2 : tensor<16xf32>
    %cst_1 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %4 = stablehlo.broadcast_in_dim %cst_1, dims = [] : (tensor<f32>) -> tensor<8x16xf32>
    %5 = stablehlo.multiply %4, %1 : tensor<8x16xf32>
    %6 = stablehlo.subtract %arg2, %5 : tensor<8x16xf32>
    %cst_2 = stablehlo.constant dense<1.000000e-01> : tensor<f32>
    %7 = stablehlo.broadcast_in_dim %cst_2, dims = [] : (tensor<f32>) -> tensor<16xf32>
    %8 = stablehlo.multiply %7, %3 : tensor<16xf32>
    %9 = stablehlo.subtract %arg3, %8 : tensor<16xf32>
    return %6, %9 : tensor<8x16xf32>, tensor<16xf32>
  }
}
